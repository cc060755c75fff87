"""Job, index and progress records: round trips, the job id, every rejection, and the catalog's ownership rule."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import msgspec
import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs import catalog
from peerd.jobs.records import (
    MAX_LOSS_POINTS,
    JobIndex,
    JobState,
    Progress,
    TaskState,
    decode_index,
    decode_job,
    decode_progress,
    downsample,
    encode_index,
    encode_job,
    encode_progress,
    job_id_of,
    new_job_record,
)
from peerd.jobs.spec import load_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.swarm.keys import job_key, jobs_key, progress_key

OWNER = "QmYTJ4YCJcMgEYmsfimctoaJWL2a6WAZN5wht9CVeWDWSz"
OTHER = "QmS4b4CzEgSbXSUgnZKvJ99r3yBsz53Psgqi7fQT4nGrNk"
T = 1_700_000_000.0
SPEC = load_job_spec("configs/jobs/gpt-tiny-demo.yaml")
replace = msgspec.structs.replace


def job(nonce: bytes = bytes(16), owner: str = OWNER, **kw):
    return new_job_record(
        owner, "default", SPEC, nonce, now=T, epoch0_start=T + 5, timing=SPEC.planning.timing(), **kw
    )


def progress(**kw) -> Progress:
    base = dict(
        job_id=job().job_id,
        peer=OTHER,
        epoch=0,
        stage=2,
        replica=0,
        step=3,
        steps=120,
        state=TaskState.RUNNING,
        tokens_per_s=100.0,
        updated_at=T + 9,
        started_at=T + 6,
        loss=3.5,
        losses=((0, 5.0), (2, 3.5)),
        bytes={"activations": 0, "gradients": 10},
    )
    return Progress(**{**base, **kw})


def test_job_record_round_trip_and_spec() -> None:
    rec = job()
    back = decode_job(encode_job(rec))
    assert back == rec
    assert back.job_spec() == SPEC
    assert back.state == JobState.PENDING and back.seq == 1


def test_job_id_binds_owner_spec_nonce_and_planning_terms() -> None:
    rec = job()
    ids = {
        rec.job_id,
        job(nonce=b"\x01" * 16).job_id,
        job(owner=OTHER).job_id,
        new_job_record(
            OWNER,
            "default",
            dataclasses.replace(SPEC, steps=7),
            bytes(16),
            now=T,
            epoch0_start=T + 5,
            timing=SPEC.planning.timing(),
        ).job_id,
        new_job_record(
            OWNER, "default", SPEC, bytes(16), now=T, epoch0_start=T + 6, timing=SPEC.planning.timing()
        ).job_id,
    }
    assert len(ids) == 5
    assert rec.job_id == job_id_of(OWNER, rec.spec, bytes(16), rec.planning)
    # the state, seq and timestamps are not part of the id: a cancel is the same job
    assert rec.with_state(JobState.CANCELLED, T + 10).job_id == rec.job_id


def test_a_tampered_record_is_refused() -> None:
    rec = job()
    for bad, code in (
        (
            replace(rec, planning=replace(rec.planning, epoch0_start=T + 100)),
            ErrorCode.BAD_SIGNATURE,
        ),  # moved
        (replace(rec, spec={**rec.spec, "steps": 200}), ErrorCode.BAD_SIGNATURE),  # valid, other spec
        (replace(rec, spec={**rec.spec, "steps": -1}), ErrorCode.CONFIG_INVALID),
        (replace(rec, updated_at=T - 1), ErrorCode.MALFORMED),
    ):
        with pytest.raises(ProtocolError) as err:
            encode_job(bad)
        assert err.value.code == code


def test_with_state_grows_seq_and_keeps_time_monotonic() -> None:
    rec = job()
    later = rec.with_state(JobState.RUNNING, T + 50).with_state(JobState.DONE, T + 40, "finished")
    assert later.seq == 3 and later.updated_at == T + 50 and later.reason == "finished"


def test_index_and_progress_round_trip() -> None:
    index = JobIndex(OWNER, (job().job_id,), T)
    assert decode_index(encode_index(index)) == index
    p = progress()
    assert decode_progress(encode_progress(p)) == p
    q = progress(loss=None, losses=(), bytes={}, state=TaskState.FAILED, reason="boom")
    assert decode_progress(encode_progress(q)) == q


@pytest.mark.parametrize(
    "change, field",
    [
        ({"step": 121}, "step"),
        ({"losses": ((3, 1.0), (3, 1.0))}, "losses"),
        ({"bytes": {"Bad-Kind": 1}}, "bytes"),
        ({"peer": "not a peer id"}, "peer"),
        ({"job_id": "xyz"}, "job_id"),
        ({"tokens_per_s": -1.0}, "tokens_per_s"),
    ],
)
def test_progress_rejections_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ProtocolError) as err:
        encode_progress(progress(**change))
    assert field in str(err.value)


def test_decoders_never_raise_anything_but_protocol_errors() -> None:
    rng = random.Random(0)
    good = [encode_job(job()), encode_index(JobIndex(OWNER, (), T)), encode_progress(progress())]
    for _ in range(3000):
        raw = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.2:
            raw = raw[: rng.randrange(len(raw))]
        for decode in (decode_job, decode_index, decode_progress):
            with contextlib.suppress(ProtocolError):
                decode(bytes(raw))


def test_downsample_keeps_ends_and_order() -> None:
    points = [(i, 10.0 - i / 100) for i in range(1000)]
    out = downsample(points)
    assert len(out) == MAX_LOSS_POINTS and out[0] == points[0] and out[-1] == points[-1]
    assert [s for s, _ in out] == sorted({s for s, _ in out})
    assert downsample(points[:5]) == tuple(points[:5])


# -- the catalog: who may write what ---------------------------------------------------------------


def test_only_the_owners_record_counts() -> None:
    async def scenario() -> None:
        dht = MemoryDHT(lambda: T + 20)
        owner, other = dht.client(OWNER), dht.client(OTHER)
        rec = job()
        await owner.put(job_key(rec.job_id), encode_job(rec), T + 1000)
        # a non-owner stores the owner's own (validly signed-looking) cancel under its subkey: ignored
        cancel = rec.with_state(JobState.CANCELLED, T + 15)
        await other.put(job_key(rec.job_id), encode_job(cancel), T + 2000)
        rejected = catalog.Rejections()
        found = await catalog.read_job(other, rec.job_id, rejected)
        assert found is not None and found.state == JobState.PENDING and rejected.not_owner == 1
        # the owner's cancel counts
        await owner.put(job_key(rec.job_id), encode_job(cancel), T + 1001)
        found = await catalog.read_job(other, rec.job_id)
        assert found is not None and found.state == JobState.CANCELLED
        # indexes: one naming another owner than its subkey is dropped
        await owner.put(jobs_key("default"), encode_index(JobIndex(OWNER, (rec.job_id,), T)), T + 1000)
        await other.put(jobs_key("default"), encode_index(JobIndex(OWNER, (rec.job_id,), T)), T + 1000)
        indexes = await catalog.read_indexes(owner, "default", rejected)
        assert [i.owner for i in indexes] == [OWNER] and rejected.not_owner == 2
        # progress: a record naming another peer than its author is dropped
        await owner.put(progress_key(rec.job_id), encode_progress(progress(job_id=rec.job_id)), T + 1000)
        await other.put(progress_key(rec.job_id), encode_progress(progress(job_id=rec.job_id)), T + 1000)
        assert list(await catalog.read_progress(owner, rec.job_id)) == [OTHER]

    asyncio.run(scenario())
