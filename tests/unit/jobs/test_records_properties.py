"""Properties of the job, job-index and progress schemas, over generated records.

encode -> decode is the identity and re-encoding gives the same bytes (one value, one byte
string); every truncation of a valid encoding is a ``ProtocolError``; a flipped byte gives a
``ProtocolError`` or a record that is itself valid, never any other exception.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.errors import ProtocolError
from peerd.jobs.records import (
    MAX_INDEX_IDS,
    MAX_LOSS_POINTS,
    MAX_REASON_CHARS,
    JobIndex,
    JobRecord,
    JobState,
    Progress,
    TaskState,
    decode_index,
    decode_job,
    decode_progress,
    encode_index,
    encode_job,
    encode_progress,
    new_job_record,
)
from peerd.jobs.spec import load_job_spec

SPEC = load_job_spec("configs/jobs/gpt-tiny-demo.yaml")
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
U64 = 2**64 - 1
SETTINGS = settings(max_examples=40, deadline=None)  # the spec parser runs on every job encode and decode

peer_ids = st.text(BASE58, min_size=16, max_size=64)
job_ids = st.text("0123456789abcdef", min_size=32, max_size=32)
times = st.floats(min_value=0.0, max_value=4e9, allow_nan=False)
reals = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
reasons = st.text(max_size=MAX_REASON_CHARS)


@st.composite
def jobs(draw: st.DrawFn) -> JobRecord:
    spec = dataclasses.replace(
        SPEC,
        name=draw(st.text(max_size=40)),
        steps=draw(st.integers(SPEC.optimizer.warmup_steps + 1, 10**9)),
        model=dataclasses.replace(SPEC.model, seed=draw(st.integers(0, 2**32))),
        optimizer=dataclasses.replace(SPEC.optimizer, lr=draw(st.floats(1e-6, 9.0))),
    )
    now = draw(times)
    rec = new_job_record(
        draw(peer_ids),
        draw(st.text(max_size=64)),
        spec,
        draw(st.binary(min_size=16, max_size=16)),
        now=now,
        epoch0_start=now + draw(st.floats(0.0, 60.0)),
        timing=spec.planning.timing(),
    )
    return msgspec.structs.replace(
        rec,
        state=draw(st.sampled_from(JobState)),
        seq=draw(st.integers(0, U64)),
        updated_at=now + draw(st.floats(0.0, 1e6)),
        reason=draw(reasons),
    )


indexes = st.builds(
    JobIndex,
    owner=peer_ids,
    job_ids=st.lists(job_ids, max_size=MAX_INDEX_IDS, unique=True).map(tuple),
    updated_at=times,
)


@st.composite
def progresses(draw: st.DrawFn) -> Progress:
    steps = draw(st.integers(0, U64))
    history = draw(st.lists(st.integers(0, steps), max_size=MAX_LOSS_POINTS, unique=True))
    losses = st.floats(allow_nan=False, allow_infinity=False)
    return Progress(
        job_id=draw(job_ids),
        peer=draw(peer_ids),
        epoch=draw(st.integers(0, U64)),
        stage=draw(st.integers(0, 64)),
        replica=draw(st.integers(0, 64)),
        step=draw(st.integers(0, steps)),
        steps=steps,
        state=draw(st.sampled_from(TaskState)),
        tokens_per_s=draw(reals),
        updated_at=draw(times),
        started_at=draw(times),
        loss=draw(st.none() | reals),
        losses=tuple((s, draw(losses)) for s in sorted(history)),
        bytes=draw(st.dictionaries(st.from_regex(r"\A[a-z0-9_]{1,32}\Z"), st.integers(0, U64), max_size=8)),
        reason=draw(reasons),
    )


def _round_trip(encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], value: Any) -> None:
    raw = encode(value)
    back = decode(raw)
    assert back == value
    assert encode(back) == raw


def _damage(
    encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], value: Any, data: st.DataObject
) -> None:
    raw = encode(value)
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    try:
        decode(raw[:cut])
    except ProtocolError:
        pass
    else:
        raise AssertionError(f"a truncation to {cut} of {len(raw)} bytes decoded")
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    flipped = bytearray(raw)
    flipped[at] ^= data.draw(st.integers(1, 255), label="mask")
    try:
        back = decode(bytes(flipped))
    except ProtocolError:
        return
    encode(back)  # a flip that still decodes (inside a reason, a time) is a valid record


@SETTINGS
@given(jobs())
def test_job_round_trip(rec: JobRecord) -> None:
    _round_trip(encode_job, decode_job, rec)


@SETTINGS
@given(indexes)
def test_index_round_trip(index: JobIndex) -> None:
    _round_trip(encode_index, decode_index, index)


@SETTINGS
@given(progresses())
def test_progress_round_trip(p: Progress) -> None:
    _round_trip(encode_progress, decode_progress, p)


@SETTINGS
@given(jobs(), st.data())
def test_damaged_job_bytes(rec: JobRecord, data: st.DataObject) -> None:
    _damage(encode_job, decode_job, rec, data)


@settings(max_examples=150, deadline=None)
@given(indexes, st.data())
def test_damaged_index_bytes(index: JobIndex, data: st.DataObject) -> None:
    _damage(encode_index, decode_index, index, data)


@settings(max_examples=150, deadline=None)
@given(progresses(), st.data())
def test_damaged_progress_bytes(p: Progress, data: st.DataObject) -> None:
    _damage(encode_progress, decode_progress, p, data)
