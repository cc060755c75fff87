"""Job, job-index, progress and votes-entry records against the byte-exact vectors in protocols/vectors/jobs/.

Each valid vector is checked against the tests' independent canonical msgpack writer
(canonical_msgpack.py: sorted keys, float64, bin for bytes), peerd's decoder and encoder,
and for job records the job id recomputed here from its definition. Invalid vectors must be
refused with their error code; ownership vectors exercise the reader's rule that only the
owner's subkey counts. Regenerate (only when the format changes on purpose):
``python tests/protocols/test_job_vectors.py --write``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.catalog import check_job_entry, decode_votes, encode_votes
from peerd.jobs.records import (
    decode_index,
    decode_job,
    decode_progress,
    encode_index,
    encode_job,
    encode_progress,
)

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "jobs"
FILES = sorted(VECTORS.glob("*.json"))
CODECS = {
    "job": (decode_job, encode_job),
    "jobs": (decode_index, encode_index),
    "progress": (decode_progress, encode_progress),
}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]
pack = canonical_msgpack.canonical  # JSON wire form -> canonical msgpack; ``{"bin": hex}`` is a bin value


def job_id(wire: dict) -> str:
    """protocols/jobs.md: first 16 bytes of sha256 over {nonce, owner, planning, spec}, as hex."""
    body = {k: wire[k] for k in ("nonce", "owner", "planning", "spec")}
    return hashlib.sha256(pack(body)).digest()[:16].hex()


def of_type(kind: str) -> list[Path]:
    return [f for f in FILES if _load(f)["type"] == kind]


def test_vector_set_is_complete() -> None:
    kinds = {_load(f)["wire"]["kind"] for f in of_type("record")}
    assert kinds == {"job", "jobs", "progress"}
    codes = {_load(f)["error"] for f in of_type("invalid")}
    assert {
        "MALFORMED",
        "UNSUPPORTED_VERSION",
        "UNKNOWN_KIND",
        "OVERSIZED",
        "BAD_SIGNATURE",
        "CONFIG_INVALID",
    } <= codes
    assert {_load(f)["error"] for f in of_type("ownership")} >= {None, "NOT_OWNER"}
    assert of_type("votes")


@pytest.mark.parametrize("path", of_type("record"), ids=lambda p: p.stem)
def test_record_vector_is_byte_exact(path: Path) -> None:
    case = _load(path)
    data = bytes.fromhex(case["bytes_hex"])
    assert pack(case["wire"]) == data
    decode, encode = CODECS[case["wire"]["kind"]]
    rec = decode(data)
    assert encode(rec) == data
    if case["wire"]["kind"] == "job":
        assert job_id(case["wire"]) == case["wire"]["job_id"] == rec.job_id


@pytest.mark.parametrize("path", of_type("invalid"), ids=lambda p: p.stem)
def test_invalid_vector_is_refused_with_its_code(path: Path) -> None:
    case = _load(path)
    decode, _ = CODECS[case["kind"]]
    with pytest.raises(ProtocolError) as err:
        decode(bytes.fromhex(case["bytes_hex"]))
    assert err.value.code == ErrorCode[case["error"]]
    if "field" in case:
        assert case["field"] in str(err.value)


@pytest.mark.parametrize("path", of_type("ownership"), ids=lambda p: p.stem)
def test_ownership_vector(path: Path) -> None:
    """A job record counts only under its owner's subkey, under its own job id."""
    case = _load(path)
    data = bytes.fromhex(case["bytes_hex"])
    if case["error"] is None:
        rec = check_job_entry(case["key_job_id"], case["author"], data, now=case["now"])
        assert rec.owner == case["author"]
        return
    with pytest.raises(ProtocolError) as err:
        check_job_entry(case["key_job_id"], case["author"], data, now=case["now"])
    assert err.value.code == ErrorCode[case["error"]]


@pytest.mark.parametrize("path", of_type("votes"), ids=lambda p: p.stem)
def test_votes_entry_vector(path: Path) -> None:
    case = _load(path)
    data = bytes.fromhex(case["bytes_hex"])
    votes = [bytes.fromhex(v) for v in case["votes_hex"]]
    assert pack([{"bin": v.hex()} for v in votes]) == data
    assert decode_votes(data) == votes
    assert encode_votes(votes) == data


# --- regeneration -------------------------------------------------------------------------------


def _write_vectors() -> None:  # pragma: no cover - run by hand
    import dataclasses

    import msgpack
    import msgspec

    from peerd.jobs.records import (
        JobIndex,
        JobState,
        Progress,
        RLFigures,
        TaskState,
        new_job_record,
    )
    from peerd.jobs.spec import load_job_spec
    from peerd.sched.consensus.messages import Vote, encode
    from peerd.wire import canonical_pack

    def wire(data: bytes) -> Any:
        def conv(x: Any) -> Any:
            if isinstance(x, bytes):
                return {"bin": x.hex()}
            if isinstance(x, dict):
                return {k: conv(v) for k, v in x.items()}
            if isinstance(x, list):
                return [conv(v) for v in x]
            return x

        return conv(msgpack.unpackb(data, raw=False))

    owner = "QmYTJ4YCJcMgEYmsfimctoaJWL2a6WAZN5wht9CVeWDWSz"
    other = "QmS4b4CzEgSbXSUgnZKvJ99r3yBsz53Psgqi7fQT4nGrNk"
    root = Path(__file__).resolve().parents[2]
    spec = load_job_spec(root / "configs" / "jobs" / "gpt-tiny-demo.yaml")
    t = 1700000000.25
    job = new_job_record(
        owner,
        "default",
        spec,
        bytes(range(16)),
        now=t,
        epoch0_start=t + 6.0,
        timing=dataclasses.replace(spec.planning, max_skew_s=1.0).timing(),
    )
    cancelled = job.with_state(JobState.CANCELLED, t + 30.5, "superseded by a larger run")
    index = JobIndex(owner, (job.job_id, "0123456789abcdef0123456789abcdef"), t + 1.0)
    last = Progress(
        job.job_id,
        other,
        0,
        2,
        1,
        40,
        120,
        TaskState.RUNNING,
        1843.75,
        t + 90.0,
        t + 20.0,
        loss=3.125,
        losses=((0, 5.5), (19, 4.0), (39, 3.125)),
        bytes={
            "activations": 0,
            "gradients": 81920,
            "gradients_raw": 655360,
            "averaging": 40960,
            "averaging_raw": 163840,
        },
    )
    first = Progress(
        job.job_id,
        owner,
        0,
        0,
        0,
        120,
        120,
        TaskState.DONE,
        2048.0,
        t + 200.0,
        t + 20.0,
        bytes={"activations": 163840, "activations_raw": 1310720, "gradients": 0, "averaging": 0},
    )
    failed = msgspec.structs.replace(
        first, state=TaskState.FAILED, step=57, reason="stage 1 unreachable [TIMEOUT]"
    )
    out: dict[str, dict] = {}

    def record(name: str, description: str, raw: bytes) -> None:
        out[name] = {"type": "record", "description": description, "wire": wire(raw), "bytes_hex": raw.hex()}

    record("job-pending", "a fresh job record: the demo spec, PENDING, seq 1", encode_job(job))
    record(
        "job-cancelled",
        "the owner's cancel: same job, state CANCELLED, seq 2, a reason",
        encode_job(cancelled),
    )
    record("index", "one owner's job index with two job ids", encode_index(index))
    record("progress-last-stage", "a running last-stage tasklet with its loss history", encode_progress(last))
    record("progress-first-stage-done", "a finished first-stage tasklet (no loss)", encode_progress(first))
    record("progress-failed", "a failed tasklet with its reason", encode_progress(failed))
    validated = msgspec.structs.replace(last, val_losses=((20, 3.5), (40, 3.25)))
    record(
        "progress-validation",
        "a last-stage tasklet of a job with a validation split: its held-out losses after 20 and 40 steps",
        encode_progress(validated),
    )
    trainer = msgspec.structs.replace(
        last,
        stage=0,
        replica=0,
        rl=RLFigures(
            version=40,
            rewards=((1, 0.125, 0.0625), (20, 0.5, 0.40625), (40, 0.75, 0.625)),
            kl=0.0312,
            response_len=3.5,
            rollouts_per_s=212.25,
            steady_rollouts_per_s=208.5,
            staleness=((0, 2048), (1, 512)),
            dropped_stale=64,
            shards_missing=1,
            weight_sync_bytes=18874368,
        ),
    )
    record(
        "progress-rl",
        "an rl job's trainer after 40 iterations: reward and pass-rate curve, KL, staleness histogram, drops",
        encode_progress(trainer),
    )

    def invalid(
        name: str, description: str, kind: str, wire_map: dict, error: str, field: str | None = None
    ) -> None:
        raw = canonical_pack(wire_map)
        out[name] = {
            "type": "invalid",
            "description": description,
            "kind": kind,
            "bytes_hex": raw.hex(),
            "error": error,
        }
        if field:
            out[name]["field"] = field

    base = msgpack.unpackb(encode_job(job), raw=False)
    invalid(
        "job-id-mismatch",
        "job_id is not the hash of the record's content",
        "job",
        {**base, "job_id": "0" * 32},
        "BAD_SIGNATURE",
        "job_id",
    )
    bad_spec = {**base, "spec": {**base["spec"], "steps": 0}}
    invalid(
        "job-bad-spec",
        "the spec inside does not validate (steps 0)",
        "job",
        bad_spec,
        "CONFIG_INVALID",
        "steps",
    )
    invalid(
        "job-unknown-state",
        "state 'paused' does not exist",
        "job",
        {**base, "state": "paused"},
        "MALFORMED",
        "state",
    )
    invalid(
        "job-short-nonce",
        "nonce must be 16 bytes",
        "job",
        {**base, "nonce": b"\x01\x02"},
        "MALFORMED",
        "nonce",
    )
    invalid("job-version-2", "a future version", "job", {**base, "v": 2}, "UNSUPPORTED_VERSION")
    invalid(
        "job-kind-peer", "a peer record is not a job record", "job", {**base, "kind": "peer"}, "UNKNOWN_KIND"
    )
    invalid("job-oversized", "more than 8 KiB", "job", {**base, "reason": "x" * 9000}, "OVERSIZED")
    invalid(
        "job-bad-timing",
        "a vote window shorter than twice the clock skew",
        "job",
        {**base, "planning": {**base["planning"], "timing": {**base["planning"]["timing"], "vote_s": 1.0}}},
        "MALFORMED",
        "timing",
    )
    ib = {"v": 1, "kind": "jobs", "owner": owner, "job_ids": [job.job_id, job.job_id], "updated_at": t}
    invalid("index-duplicate", "a job id listed twice", "jobs", ib, "MALFORMED", "job_ids")
    pb = msgpack.unpackb(encode_progress(last), raw=False)
    invalid("progress-step-beyond", "step 121 of 120", "progress", {**pb, "step": 121}, "MALFORMED", "step")
    invalid(
        "progress-losses-unsorted",
        "loss history out of order",
        "progress",
        {**pb, "losses": [[39, 3.1], [19, 4.0]]},
        "MALFORMED",
        "losses",
    )
    pv = msgpack.unpackb(encode_progress(validated), raw=False)
    invalid(
        "progress-val-losses-unsorted",
        "held-out loss history out of order",
        "progress",
        {**pv, "val_losses": [[40, 3.25], [20, 3.5]]},
        "MALFORMED",
        "val_losses",
    )
    pr = msgpack.unpackb(encode_progress(trainer), raw=False)
    invalid(
        "progress-rl-pass-rate-above-one",
        "a pass rate of 1.5",
        "progress",
        {**pr, "rl": {**pr["rl"], "rewards": [[1, 0.1, 1.5]]}},
        "MALFORMED",
        "rl.rewards",
    )
    invalid(
        "progress-nan-loss",
        "NaN is not a loss",
        "progress",
        {**pb, "loss": float("nan")},
        "MALFORMED",
        "loss",
    )

    def ownership(name: str, description: str, raw: bytes, key: str, author: str, error: str | None) -> None:
        out[name] = {
            "type": "ownership",
            "description": description,
            "bytes_hex": raw.hex(),
            "key_job_id": key,
            "author": author,
            "now": t + 60.0,
            "error": error,
        }

    ownership(
        "owner-cancel-counts",
        "the owner's cancel under the owner's subkey",
        encode_job(cancelled),
        job.job_id,
        owner,
        None,
    )
    ownership(
        "non-owner-cancel-ignored",
        "the same bytes stored under another peer's subkey",
        encode_job(cancelled),
        job.job_id,
        other,
        "NOT_OWNER",
    )
    forged = new_job_record(
        other, "default", spec, bytes(range(16)), now=t, epoch0_start=t + 6.0, timing=job.timing
    )
    forged = forged.with_state(JobState.CANCELLED, t + 30.5)
    ownership(
        "other-job-under-this-key",
        "a (valid) record of another job stored under this job's key",
        encode_job(forged),
        job.job_id,
        other,
        "MALFORMED",
    )
    ownership(
        "record-from-future",
        "updated 40 s after the reader's clock",
        encode_job(cancelled),
        job.job_id,
        owner,
        None,
    )
    out["record-from-future"]["now"] = cancelled.updated_at - 40.0
    out["record-from-future"]["error"] = "FROM_FUTURE"

    v0 = Vote(job.job_id, 0, 0, other, t + 22.0, bytes(range(32)), 0.0264547, bytes(range(32, 64)))
    v1 = msgspec.structs.replace(v0, round=1, issued_at=t + 25.5)
    votes = [encode(v0), encode(v1)]
    out["votes-entry"] = {
        "type": "votes",
        "description": "one voter's value under votes_key: its round-0 and round-1 votes, as bin, round order",
        "votes_hex": [v.hex() for v in votes],
        "bytes_hex": encode_votes(votes).hex(),
    }
    VECTORS.mkdir(parents=True, exist_ok=True)
    for old in VECTORS.glob("*.json"):
        old.unlink()
    for name, case in out.items():
        (VECTORS / f"{name}.json").write_text(json.dumps(case, indent=2, sort_keys=False) + "\n")
    print(f"wrote {len(out)} vectors to {VECTORS}")


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] == ["--write"]:
        _write_vectors()
