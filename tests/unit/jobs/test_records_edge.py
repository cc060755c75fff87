"""Strict at the edge: whatever a peer puts in the spec of a correctly hashed job record, readers get
a valid record or a ``ProtocolError`` (never a crash), and the daemon's consumers skip the bad
record while every other job keeps working (the ``data.seq_len: null`` incident of issue 9).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs import catalog, records
from peerd.jobs.manager import JobManager, ManagerConfig
from peerd.jobs.records import (
    JobIndex,
    JobRecord,
    decode_job,
    encode_index,
    encode_job,
    job_id_of,
    new_job_record,
)
from peerd.jobs.spec import load_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.swarm.keys import job_key, jobs_key
from peerd.wire import canonical_pack, to_builtin

OWNER = "QmYTJ4YCJcMgEYmsfimctoaJWL2a6WAZN5wht9CVeWDWSz"
READER = "QmS4b4CzEgSbXSUgnZKvJ99r3yBsz53Psgqi7fQT4nGrNk"
T = 1_700_000_000.0
SPEC = load_job_spec("configs/jobs/gpt-tiny-demo.yaml")
BAD_VALUES: list[Any] = [None, 0, -1, "x", True, []]


def record(nonce: bytes = bytes(16)) -> JobRecord:
    return new_job_record(
        OWNER, "default", SPEC, nonce, now=T, epoch0_start=T + 5, timing=SPEC.planning.timing()
    )


def signed_bytes(rec: JobRecord, spec: dict[str, Any]) -> bytes:
    """The owner's bytes of ``rec`` carrying ``spec``, with a job id that hashes it (no receiver checks)."""
    job_id = job_id_of(rec.owner, spec, rec.nonce, rec.planning)
    tree = to_builtin(msgspec.structs.replace(rec, spec=spec, job_id=job_id))
    del tree["reason"]  # empty: absent on the wire
    return canonical_pack(tree)


def paths(tree: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key of the nested spec map, and every list item, depth first."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield (*at, key)
        yield from paths(value, (*at, key))


def with_value(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(tree)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def test_the_valid_record_is_accepted_as_is() -> None:
    rec = record()
    assert decode_job(signed_bytes(rec, rec.spec)) == rec


def test_every_spec_field_set_to_junk_gives_a_valid_record_or_a_protocol_error() -> None:
    rec = record()
    all_paths = list(paths(rec.spec))
    assert len(all_paths) > 40 and ("data", "seq_len") in all_paths and ("optimizer", "betas", 0) in all_paths
    refused = 0
    for path in all_paths:
        for value in BAD_VALUES:
            raw = signed_bytes(rec, with_value(rec.spec, path, value))
            try:
                back = decode_job(raw)
            except ProtocolError as exc:
                refused += 1
                assert "spec" in str(exc), (path, value, exc)
                continue
            # accepted: then it is a record every consumer can use
            back.job_spec()
            assert encode_job(back) == raw, (path, value)
    assert refused > len(all_paths)  # most of the junk is refused, not silently taken


def test_the_incident_record_names_the_field() -> None:
    rec = record()
    with pytest.raises(ProtocolError) as err:
        decode_job(signed_bytes(rec, with_value(rec.spec, ("data", "seq_len"), None)))
    assert "spec.data.seq_len" in str(err.value)


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"data": {"seq_len": {"deeper": {"still": 1}}}},  # deeper than any job spec
        {"model": b"\x00" * 8},
        {"steps": 1.5},
        {"optimizer": {"lr": float("nan")}},
    ],
    ids=["empty", "too-deep", "bytes", "float-steps", "nan"],
)
def test_odd_spec_shapes_are_refused(spec: dict[str, Any]) -> None:
    rec = record()
    with pytest.raises(ProtocolError):
        decode_job(signed_bytes(rec, {**rec.spec, **spec} if spec else spec))


@pytest.mark.parametrize(
    "error", [TypeError, ValueError, AttributeError, ZeroDivisionError, KeyError, RecursionError]
)
def test_a_crash_of_the_spec_parser_is_the_bytes_fault(monkeypatch: pytest.MonkeyPatch, error: type) -> None:
    """The parser was written for files: if some spec makes it raise, the record is MALFORMED, not a reader crash."""

    def crash(data: Any, source: str = "") -> Any:
        raise error("the parser tripped")

    rec = record()
    monkeypatch.setattr(records, "parse_job_spec", crash)
    with pytest.raises(ProtocolError) as err:
        decode_job(signed_bytes(rec, rec.spec))
    assert err.value.code == ErrorCode.MALFORMED and "spec" in str(err.value)


@pytest.mark.parametrize(
    "path",
    [("data", "paths"), ("data", "hf_data_files"), ("checkpoint_interval",), ("model", "overrides")],
    ids=lambda p: ".".join(p),
)
def test_long_lists_and_maps_in_a_spec_are_refused_before_the_spec_parser(
    monkeypatch: pytest.MonkeyPatch, path: tuple[str, ...]
) -> None:
    """4096 wrongly typed items fit in 8 KiB and cost the parser an error object each (issue 15's
    fuzzing: 138 ms, 2.9 MB for one record): the record's schema counts them first."""
    rec = record()
    many: Any = (
        {f"k{i}": 0 for i in range(records.MAX_SPEC_KEYS + 1)} if path[-1] == "overrides" else [0] * 4096
    )
    raw = signed_bytes(rec, with_value(rec.spec, path, many))
    assert len(raw) <= records.MAX_JOB_BYTES
    monkeypatch.setattr(records, "parse_job_spec", pytest.fail)  # never reached
    with pytest.raises(ProtocolError) as err:
        decode_job(raw)
    assert err.value.code == ErrorCode.OVERSIZED and f"spec.{'.'.join(path)}" in str(err.value)


def test_a_list_within_the_bound_still_reaches_the_spec_parser() -> None:
    rec = record()
    raw = signed_bytes(rec, with_value(rec.spec, ("data", "paths"), [0] * records.MAX_SPEC_ITEMS))
    with pytest.raises(ProtocolError) as err:
        decode_job(raw)
    assert err.value.code == ErrorCode.CONFIG_INVALID and "spec.data.paths[0]" in str(err.value)


# -- the consumers: catalog and manager reading the records from the store -------------------------


def publish(dht: MemoryDHT, good: JobRecord, bad: bytes, bad_id: str) -> None:
    async def go() -> None:
        owner = dht.client(OWNER)
        await owner.put(
            jobs_key("default"), encode_index(JobIndex(OWNER, (bad_id, good.job_id), T)), T + 10**6
        )
        await owner.put(job_key(good.job_id), encode_job(good), T + 10**6)
        await owner.put(job_key(bad_id), bad, T + 10**6)

    asyncio.run(go())


def bad_record() -> tuple[bytes, str]:
    rec = record(nonce=b"\x07" * 16)
    spec = with_value(rec.spec, ("data", "seq_len"), None)
    return signed_bytes(rec, spec), job_id_of(rec.owner, spec, rec.nonce, rec.planning)


def test_catalog_skips_the_bad_record_and_reads_the_good_one(caplog: pytest.LogCaptureFixture) -> None:
    dht = MemoryDHT(lambda: T + 1)
    good, (bad, bad_id) = record(), bad_record()
    publish(dht, good, bad, bad_id)
    reader, rejected = dht.client(READER), catalog.Rejections()

    async def read() -> tuple[Any, Any, Any]:
        indexes = await catalog.read_indexes(reader, "default", rejected)
        return (
            indexes,
            await catalog.read_job(reader, bad_id, rejected),
            await catalog.read_job(reader, good.job_id),
        )

    with caplog.at_level(logging.INFO, logger="peerd.jobs.catalog"):
        indexes, missing, found = asyncio.run(read())
    assert [i.job_ids for i in indexes] == [(bad_id, good.job_id)]
    assert missing is None and found == good and rejected.malformed == 1
    assert any(bad_id in r.getMessage() and "spec.data.seq_len" in r.getMessage() for r in caplog.records)


def test_the_manager_keeps_every_other_job_working(caplog: pytest.LogCaptureFixture) -> None:
    dht = MemoryDHT(lambda: T + 1)
    good, (bad, bad_id) = record(), bad_record()
    publish(dht, good, bad, bad_id)
    manager = JobManager(
        dht.client(READER),
        "default",
        local=lambda: pytest.fail("planning is not under test"),
        online=lambda: [OWNER, READER],
    )

    async def scenario() -> list[dict[str, Any]]:
        try:
            for _ in range(2):  # and again: the bad record never turns into an internal error
                await manager.discover()
            return await manager.list_jobs({})  # what `peerd jobs` asks
        finally:
            await manager.close()

    with caplog.at_level(logging.INFO, logger="peerd.jobs.catalog"):
        listed = asyncio.run(scenario())
    assert list(manager.jobs) == [good.job_id]
    assert [v["job_id"] for v in listed] == [good.job_id]
    assert manager.rejected.malformed >= 1
    assert any(bad_id in r.getMessage() for r in caplog.records)


def test_nil_in_an_optional_record_field_reads_as_absent_but_the_spec_keeps_its_nils():
    rec = record()
    tree = to_builtin(rec)
    tree["reason"] = None  # protocols/README.md: nil in an optional field is absent
    assert decode_job(canonical_pack(tree)) == rec
    spec = copy.deepcopy(rec.spec)
    spec["data"]["seq_len"] = None  # inside the spec nil is a value, and this one is refused
    with pytest.raises(ProtocolError, match=r"spec\.data\.seq_len"):
        decode_job(signed_bytes(rec, spec))


def test_a_job_whose_reading_crashes_is_skipped_and_the_others_are_still_discovered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dht = MemoryDHT(lambda: T + 1)
    good, (bad, bad_id) = record(), bad_record()
    publish(dht, good, bad, bad_id)
    real_read = catalog.read_job

    async def read_job(store: Any, job_id: str, rejected: Any) -> Any:
        if job_id == bad_id:  # stands for a decoder bug: an exception no check anticipated
            raise TypeError("'<' not supported between instances of 'NoneType' and 'int'")
        return await real_read(store, job_id, rejected)

    monkeypatch.setattr(catalog, "read_job", read_job)
    manager = JobManager(dht.client(READER), "default", local=lambda: None, online=lambda: [OWNER, READER])

    async def scenario() -> None:
        try:
            await manager.discover()
        finally:
            await manager.close()

    with caplog.at_level(logging.ERROR, logger="peerd.jobs.manager"):
        asyncio.run(scenario())
    assert list(manager.jobs) == [good.job_id]
    assert any(f"job {bad_id}: skipped" in r.getMessage() for r in caplog.records)


def test_the_jobs_loop_survives_a_round_that_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    dht = MemoryDHT(lambda: T + 1)
    manager = JobManager(
        dht.client(READER),
        "default",
        local=lambda: None,
        online=lambda: [READER],
        config=ManagerConfig(discover_s=0.01),
    )
    rounds: list[int] = []

    async def scenario() -> None:
        second = asyncio.Event()

        async def discover(store: object = None) -> None:
            rounds.append(len(rounds))
            if len(rounds) == 1:
                raise RuntimeError("a bug in one round")
            second.set()

        monkeypatch.setattr(manager, "discover", discover)
        loop = asyncio.ensure_future(manager.run())
        try:
            await asyncio.wait_for(second.wait(), 10)  # a hang guard: the second round comes at once
            assert not loop.done()
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    asyncio.run(scenario())
    assert rounds[:2] == [0, 1]
