"""rl frames against the byte-exact vectors in protocols/vectors/rl/ (see protocols/rl.md).

``python tests/protocols/test_rl_vectors.py --write`` regenerates the vectors from the current
encoder; the tests then pin them. Every vector is read with the limits of its side and, for
``rl.rollouts``, checked against the job bounds written in the vector (``check_rollouts``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.errors import ErrorCode, PeerdError
from peerd.jobs.rl.messages import (
    REPLY_KINDS,
    REQUEST_KINDS,
    Ack,
    Poll,
    RolloutBounds,
    RolloutGroupWire,
    Rollouts,
    Status,
    check_rollouts,
    header,
    parse,
)
from peerd.rl.weights import pack_weights, read_weights
from peerd.swarm.framing import FrameLimits, encode_frame, encode_prefix, error_header, read_frame

_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "rl"
# the job every vector is read for: 8 iterations, 4 prompts in 2 shards, groups of 2, 4 new tokens
BOUNDS = {
    "iterations": 8,
    "shards": [[0, 2], [2, 4]],
    "group_size": 2,
    "max_new_tokens": 4,
    "vocab_size": 256,
}
REPLY_LIMITS = FrameLimits(max_header=4096, max_payload=0)


def bounds_of(case: dict[str, Any]) -> RolloutBounds:
    b = case["bounds"]
    return RolloutBounds(
        iterations=b["iterations"],
        shards=[range(a, z) for a, z in b["shards"]],
        group_size=b["group_size"],
        max_new_tokens=b["max_new_tokens"],
        vocab_size=b["vocab_size"],
    )


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _files(kind: str) -> list[Path]:
    return [p for p in sorted(VECTORS.glob("*.json")) if _load(p)["type"] == kind]


def _limits(case: dict[str, Any]) -> FrameLimits:
    if case["side"] == "request":
        return FrameLimits(max_header=bounds_of(case).frame_bytes(), max_payload=0)
    return FrameLimits(max_header=REPLY_LIMITS.max_header, max_payload=case.get("payload_limit", 0))


def _kinds(side: str) -> tuple[str, ...]:
    return REQUEST_KINDS if side == "request" else REPLY_KINDS


def _decode(data: bytes, limits: FrameLimits):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, limits=limits, timeout=1.0)

    return asyncio.run(go())


def _read(case: dict[str, Any]) -> Any:
    """What a receiver does with the frame: read it, parse it, check a shard against the job."""
    head, _, _ = _decode(bytes.fromhex(case["frame_hex"]), _limits(case))
    msg = parse(head, _kinds(case["side"]))
    if isinstance(msg, Rollouts):
        check_rollouts(msg, bounds_of(case))
    return msg


# ---------------------------------------------------------------- generation

ROLLOUTS = Rollouts(
    iteration=3,
    shard=1,
    version=2,
    groups=[
        RolloutGroupWire(
            problem=2, completions=[[49, 55, 10], [52, 10]], logprobs=[[-0.25, -1.5, -0.125], [-3.0, 0.0]]
        ),
        RolloutGroupWire(
            problem=3, completions=[[57, 57, 57, 57], [10]], logprobs=[[-2.0, -0.5, -0.5, -0.5], [-4.0]]
        ),
    ],
)


def _frame(side: str, desc: str, head: dict[str, Any], payload: bytes = b"", **extra: Any) -> dict[str, Any]:
    if payload:  # read with a payload limit of its size: the poller's inline_bytes
        extra |= {"payload_hex": payload.hex(), "payload_limit": len(payload)}
    return {
        "type": "frame",
        "side": side,
        "description": desc,
        "bounds": BOUNDS,
        "header": head,
        "frame_hex": encode_frame(head, payload).hex(),
        **extra,
    }


def _rollouts_with(**changes: Any) -> dict[str, Any]:
    """A copy of the valid rollouts header with top-level fields replaced."""
    head = json.loads(json.dumps(header(ROLLOUTS)))
    for key, value in changes.items():
        head[key] = value
    return head


def _group_edit(gi: int, field: str, ci: int, value: Any) -> dict[str, Any]:
    head = _rollouts_with()
    head["groups"][gi][field][ci] = value
    return head


def generate() -> dict[str, dict[str, Any]]:
    rollouts = header(ROLLOUTS)
    ack = header(Ack(iteration=3, shard=1, version=3, accepted=True))
    out = {
        "valid-rollouts": _frame(
            "request",
            "shard 1 of iteration 3 (problems 2 and 3, 2 completions each) sampled by version 2",
            rollouts,
        ),
        "valid-ack": _frame("reply", "taken; the trainer has published version 3", ack),
        "valid-ack-stale": _frame(
            "reply",
            "not taken: the shard's version is too old (a drop, counted; the stream goes on)",
            header(
                Ack(
                    iteration=3,
                    shard=1,
                    version=3,
                    accepted=False,
                    reason="version 0 is more than 1 behind iteration 3",
                )
            ),
        ),
        "valid-poll": _frame("request", "answer when you hold version 4", header(Poll(want=4))),
        "valid-poll-inline": _frame(
            "request",
            "answer when you hold version 4; I hold version 3 and take weights up to 1 MiB inline",
            header(Poll(want=4, held=3, inline_bytes=1 << 20)),
        ),
        "valid-status-weights": _frame(
            "reply",
            "version 4, its packed weights in the payload (8 stand-in bytes here)",
            header(Status(version=4, done=False, weights=True)),
            b"weights!",
        ),
        "valid-status": _frame("reply", "the latest version is 4", header(Status(version=4, done=False))),
        "valid-status-done": _frame("reply", "the job is over", header(Status(version=8, done=True))),
        "valid-status-warming-up": _frame(
            "reply",
            "no version yet: the trainer still warms up",
            header(Status(version=0, done=False, ready=False)),
        ),
        "valid-status-without-ready": _frame(
            "reply",
            "ready absent reads as true",
            {"kind": "rl.status", "v": 1, "version": 4, "done": False},
            decode_only=True,
        ),
        "valid-rollouts-unknown-field": _frame(
            "request",
            "an unknown field is ignored (tolerant within v1)",
            rollouts | {"seed": 7},
            decode_only=True,
        ),
        "valid-error-wrong-step": _frame(
            "reply",
            "a refusal: the shard's iteration is more than the staleness ahead",
            error_header(
                ErrorCode.WRONG_STEP, "rollouts for iteration 6 while iteration 3 trains (at most 1 ahead)"
            ),
            error="WRONG_STEP",
        ),
    }
    nan, inf = float("nan"), float("inf")
    bad: dict[str, tuple[str, dict[str, Any], bytes, str, str]] = {
        "bad-version": (
            "request",
            _rollouts_with(v=2),
            b"",
            "UNSUPPORTED_VERSION",
            "rl.rollouts of version 2",
        ),
        "bad-kind": (
            "request",
            _rollouts_with(kind="rl.weights"),
            b"",
            "UNKNOWN_KIND",
            "a kind v1 does not define",
        ),
        "bad-reply-as-request": ("request", ack, b"", "UNKNOWN_KIND", "an ack sent to the trainer"),
        "bad-payload": ("request", rollouts, b"x", "OVERSIZED", "rl frames carry no payload"),
        "bad-iteration-bool": (
            "request",
            _rollouts_with(iteration=True),
            b"",
            "MALFORMED",
            "iteration as a bool",
        ),
        "bad-missing-version": (
            "request",
            {k: v for k, v in rollouts.items() if k != "version"},
            b"",
            "MALFORMED",
            "no policy version",
        ),
        "bad-token-negative": (
            "request",
            _group_edit(0, "completions", 0, [-1, 55, 10]),
            b"",
            "MALFORMED",
            "a negative token id",
        ),
        "bad-token-vocab": (
            "request",
            _group_edit(0, "completions", 0, [300, 55, 10]),
            b"",
            "OUT_OF_RANGE",
            "token 300 outside the job's vocabulary of 256",
        ),
        "bad-logprob-nan": (
            "request",
            _group_edit(0, "logprobs", 0, [nan, -1.5, -0.125]),
            b"",
            "NON_FINITE",
            "a NaN log-prob",
        ),
        "bad-logprob-inf": (
            "request",
            _group_edit(0, "logprobs", 0, [-inf, -1.5, -0.125]),
            b"",
            "NON_FINITE",
            "a -inf log-prob",
        ),
        "bad-logprob-positive": (
            "request",
            _group_edit(0, "logprobs", 0, [0.5, -1.5, -0.125]),
            b"",
            "OUT_OF_RANGE",
            "a log-prob above 0",
        ),
        "bad-logprob-count": (
            "request",
            _group_edit(0, "logprobs", 0, [-0.25, -1.5]),
            b"",
            "MALFORMED",
            "two log-probs for three tokens",
        ),
        "bad-tokens-without-logprobs": (
            "request",
            _group_edit(1, "completions", 0, [57, 57, 57, 57, 57]),
            b"",
            "MALFORMED",
            "five tokens and four log-probs",
        ),
        "bad-end-in-middle": (
            "request",
            _group_edit(0, "completions", 1, [10, 10]),
            b"",
            "MALFORMED",
            "a completion that goes on after its end marker",
        ),
        "bad-unfinished-short": (
            "request",
            _group_edit(1, "completions", 1, [57]),
            b"",
            "MALFORMED",
            "a completion without an end marker, shorter than max_new_tokens",
        ),
        "bad-empty-completion": (
            "request",
            _group_edit(1, "completions", 1, []),
            b"",
            "MALFORMED",
            "an empty completion",
        ),
        "bad-group-size": (
            "request",
            _rollouts_with(
                groups=[
                    {"problem": 2, "completions": [[10]], "logprobs": [[-1.0]]},
                    header(ROLLOUTS)["groups"][1],
                ]
            ),
            b"",
            "MALFORMED",
            "one completion where the group size is 2",
        ),
        "bad-problem-outside-shard": (
            "request",
            _rollouts_with(groups=[dict(header(ROLLOUTS)["groups"][1], problem=0)]),
            b"",
            "MALFORMED",
            "problem 0 belongs to shard 0",
        ),
        "bad-problem-twice": (
            "request",
            _rollouts_with(groups=[header(ROLLOUTS)["groups"][1]] * 2),
            b"",
            "MALFORMED",
            "problem 3 twice",
        ),
        "bad-iteration-beyond-job": (
            "request",
            _rollouts_with(iteration=8),
            b"",
            "WRONG_STEP",
            "iteration 8 of a job of 8 iterations",
        ),
        "bad-shard": (
            "request",
            _rollouts_with(shard=2),
            b"",
            "NOT_ALLOWED",
            "shard 2 of a job with 2 shards",
        ),
        "bad-ack-reason-long": (
            "reply",
            ack | {"reason": "x" * 201},
            b"",
            "MALFORMED",
            "a reason over 200 characters",
        ),
        "bad-status-missing-done": (
            "reply",
            {"kind": "rl.status", "v": 1, "version": 4},
            b"",
            "MALFORMED",
            "a status without done",
        ),
    }
    # a completion over max_new_tokens with matching log-probs (the length check of the job)
    long = _rollouts_with()
    long["groups"][1]["completions"][0] = [57] * 5
    long["groups"][1]["logprobs"][0] = [-1.0] * 5
    bad["bad-over-max-new-tokens"] = (
        "request",
        long,
        b"",
        "OVERSIZED",
        "five tokens where max_new_tokens is 4",
    )
    for name, (side, head, payload, code, desc) in bad.items():
        out[name] = {
            "type": "invalid",
            "side": side,
            "description": desc,
            "bounds": BOUNDS,
            "frame_hex": encode_frame(head, payload).hex(),
            "error": code,
        }
    return out | generate_weights()


# the policy of the weights vectors: two tensors, 5 values (protocols/rl.md, "Weights blob")
WEIGHTS_VERSION = 5
WEIGHTS = {"a": ([2], [1.5, -2.0]), "b.wt": ([1, 3], [0.25, 0.0, -0.125])}


def _weights_blob(version: int = WEIGHTS_VERSION, values: dict[str, Any] | None = None) -> bytes:
    tensors = {
        name: torch.tensor(vals, dtype=torch.float32).reshape(shape)
        for name, (shape, vals) in (values or WEIGHTS).items()
    }
    return pack_weights(version, tensors)


def _weights_case(kind: str, desc: str, blob: bytes, **extra: Any) -> dict[str, Any]:
    return {
        "type": kind,
        "description": desc,
        "version": WEIGHTS_VERSION,
        "tensors": {name: {"shape": shape, "values": vals} for name, (shape, vals) in WEIGHTS.items()},
        "blob_hex": blob.hex(),
        **extra,
    }


def generate_weights() -> dict[str, dict[str, Any]]:
    good = _weights_blob()
    index_len = struct.unpack_from("<I", good, 4)[0]
    data = len(good) - 4 * 5  # where the values start
    nan = bytearray(good)
    struct.pack_into("<f", nan, data + 4, float("nan"))
    padded = bytearray(good)
    padded[8 + index_len] = 1  # the index leaves padding before the data: it must be zero
    assert data > 8 + index_len
    bad = {
        "bad-weights-magic": (b"PK" + good[2:], "MALFORMED", "a zip archive's magic (the torch.save format)"),
        "bad-weights-format": (good[:2] + b"\x02" + good[3:], "UNSUPPORTED_VERSION", "format 2"),
        "bad-weights-version": (_weights_blob(version=4), "WRONG_STEP", "version 4 where 5 was asked for"),
        "bad-weights-shape": (
            _weights_blob(values={"a": ([2], [1.5, -2.0]), "b.wt": ([3, 1], [0.25, 0.0, -0.125])}),
            "SHAPE_MISMATCH",
            "b.wt of shape [3, 1] where the model's is [1, 3]",
        ),
        "bad-weights-name": (
            _weights_blob(values={"a": ([2], [1.5, -2.0]), "b.vt": ([1, 3], [0.25, 0.0, -0.125])}),
            "SHAPE_MISMATCH",
            "a tensor the model does not have",
        ),
        "bad-weights-truncated": (good[:-4], "MALFORMED", "the last value missing"),
        "bad-weights-trailing": (good + b"\x00", "MALFORMED", "a byte after the last value"),
        "bad-weights-padding": (bytes(padded), "MALFORMED", "a non-zero padding byte"),
        "bad-weights-index-length": (
            good[:4] + struct.pack("<I", len(good)) + good[8:],
            "OVERSIZED",
            "an index longer than the blob",
        ),
        "bad-weights-nan": (bytes(nan), "NON_FINITE", "a NaN value"),
    }
    out = {"valid-weights": _weights_case("weights", "version 5 of a two-tensor policy", good)}
    for name, (blob, code, desc) in bad.items():
        out[name] = _weights_case("weights-invalid", desc, blob, error=code)
    return out


# ---------------------------------------------------------------- tests


def test_vector_set_is_complete():
    names = {p.stem for p in VECTORS.glob("*.json")}
    assert {"valid-rollouts", "valid-ack", "valid-poll", "valid-status"} <= names
    codes = {_load(p)["error"] for p in _files("invalid")}
    assert {
        "UNSUPPORTED_VERSION",
        "UNKNOWN_KIND",
        "MALFORMED",
        "OVERSIZED",
        "NON_FINITE",
        "OUT_OF_RANGE",
    } <= codes
    assert {"WRONG_STEP", "NOT_ALLOWED"} <= codes


def test_vectors_are_what_the_encoder_writes():
    expected = json.loads(json.dumps(generate()))  # as the files hold it (NaN lives in frame_hex only)
    assert {p.stem for p in VECTORS.glob("*.json")} == set(expected)
    for name, case in expected.items():
        assert _load(VECTORS / f"{name}.json") == case, name


@pytest.mark.parametrize("path", _files("frame"), ids=lambda p: p.stem)
def test_frame_vectors_decode_and_reencode_byte_exact(path: Path):
    case = _load(path)
    frame = bytes.fromhex(case["frame_hex"])
    got_header, payload, wire = _decode(frame, _limits(case))
    carried = bytes.fromhex(case.get("payload_hex", ""))
    assert wire == len(frame) and bytes(payload) == carried
    if "error" in case:
        assert got_header["code"] == ErrorCode[case["error"]]
        return
    msg = _read(case)
    again = encode_frame(header(msg), carried)
    if case.get("decode_only"):
        assert again != frame and _read({**case, "frame_hex": again.hex()}) == msg
    else:
        assert again == frame and encode_frame(case["header"], carried) == frame
        # the same bytes from the spec's encoding rules alone, not from peerd's encoder
        raw = canonical_msgpack.canonical(case["header"])
        assert encode_prefix(len(raw), len(carried)) + raw + carried == frame


@pytest.mark.parametrize("path", _files("invalid"), ids=lambda p: p.stem)
def test_invalid_vectors_are_rejected_with_their_code(path: Path):
    case = _load(path)
    with pytest.raises(PeerdError) as info:
        _read(case)
    assert info.value.code == ErrorCode[case["error"]]


def _model_of(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The receiver's own tensors: the vector's names and shapes, all zero."""
    return {name: torch.zeros(t["shape"]) for name, t in case["tensors"].items()}


def test_the_weights_blob_is_its_layout_byte_for_byte():
    """The valid blob from the page's layout alone: prefix, canonical msgpack index, zero padding, LE float32."""
    case = _load(VECTORS / "valid-weights.json")
    index = canonical_msgpack.canonical(
        {"tensors": [[name, t["shape"]] for name, t in case["tensors"].items()], "version": case["version"]}
    )
    head = b"PW" + bytes([1, 0]) + struct.pack("<I", len(index)) + index
    head += bytes(-len(head) % 8)
    values = [v for t in case["tensors"].values() for v in t["values"]]
    assert head + struct.pack(f"<{len(values)}f", *values) == bytes.fromhex(case["blob_hex"])


def test_the_valid_weights_vector_reads_into_the_model():
    case = _load(VECTORS / "valid-weights.json")
    model = _model_of(case)
    read_weights(bytes.fromhex(case["blob_hex"]), model, case["version"])
    for name, t in case["tensors"].items():
        assert model[name].flatten().tolist() == t["values"]


@pytest.mark.parametrize("path", _files("weights-invalid"), ids=lambda p: p.stem)
def test_invalid_weights_are_refused_with_their_code_and_leave_the_model_as_it_was(path: Path):
    case = _load(path)
    model = _model_of(case)
    with pytest.raises(PeerdError) as info:
        read_weights(bytes.fromhex(case["blob_hex"]), model, case["version"])
    assert info.value.code == ErrorCode[case["error"]]
    assert all(not t.any() for t in model.values())


def test_a_shard_at_the_size_bound_fits_the_frame_limit():
    """The trainer's header limit (``frame_bytes``) holds the largest honest shard of its job."""
    b = bounds_of({"bounds": BOUNDS})
    widest = Rollouts(
        iteration=2**31,
        shard=1,
        version=2**31,
        groups=[
            RolloutGroupWire(
                problem=2**31 + i,
                completions=[[255] * b.max_new_tokens] * b.group_size,
                logprobs=[[-1.2345678901234567e-300] * b.max_new_tokens] * b.group_size,
            )
            for i in range(2)
        ],
    )
    assert len(encode_frame(header(widest))) - 16 <= b.frame_bytes()


if __name__ == "__main__" and "--write" in sys.argv:
    VECTORS.mkdir(parents=True, exist_ok=True)
    for old in VECTORS.glob("*.json"):
        old.unlink()
    for name, case in generate().items():
        (VECTORS / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")
    print(f"wrote {len(list(VECTORS.glob('*.json')))} vectors to {VECTORS}")
