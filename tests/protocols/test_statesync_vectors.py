"""State transfer frames against the byte-exact vectors in protocols/vectors/statesync/ (see protocols/statesync.md).

``python tests/protocols/test_statesync_vectors.py --write`` regenerates the vectors from the
current encoder; the tests then pin them, and check the session vector's sizes and hash
against their definition (sha256 of the blob, chunks of at most ``chunk`` bytes in order).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from peerd.errors import ErrorCode, PeerdError
from peerd.pipeline.statesync import (
    REPLY_KINDS,
    REQUEST_KINDS,
    ChunkRequest,
    Data,
    Describe,
    Info,
    chunk_plan,
    header,
    parse,
)
from peerd.swarm.framing import FrameLimits, encode_frame, encode_prefix, error_header, read_frame

# the independent canonical msgpack writer (tests/protocols/canonical_msgpack.py), loaded by path
_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "statesync"
BLOB = b"peerd state blob, 37 bytes long......"  # stands for a torch.save file
SHA = hashlib.sha256(BLOB).digest()
CHUNK = 16
REQUEST_LIMITS = FrameLimits(max_header=4096, max_payload=0)
REPLY_LIMITS = FrameLimits(max_header=8192, max_payload=CHUNK)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _files(kind: str) -> list[Path]:
    return [p for p in sorted(VECTORS.glob("*.json")) if _load(p)["type"] == kind]


def _decode(data: bytes, limits: FrameLimits):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, limits=limits, timeout=1.0)

    return asyncio.run(go())


def _kinds(side: str) -> tuple[str, ...]:
    return REQUEST_KINDS if side == "request" else REPLY_KINDS


def _limits(side: str) -> FrameLimits:
    return REQUEST_LIMITS if side == "request" else REPLY_LIMITS


# ---------------------------------------------------------------- generation


def _json_header(head: dict[str, Any]) -> dict[str, Any]:
    """JSON cannot hold bytes: a ``bin`` value (the sha256) is written ``{"bin": "<hex>"}``."""
    return {k: {"bin": v.hex()} if isinstance(v, bytes) else v for k, v in head.items()}


def _wire_header(head: dict[str, Any]) -> dict[str, Any]:
    return {k: bytes.fromhex(v["bin"]) if isinstance(v, dict) else v for k, v in head.items()}


def _frame(side: str, desc: str, head: dict[str, Any], payload: bytes = b"", **extra: Any) -> dict[str, Any]:
    return {
        "type": "frame",
        "side": side,
        "description": desc,
        "header": _json_header(head),
        "payload_hex": payload.hex(),
        "frame_hex": encode_frame(head, payload).hex(),
        **extra,
    }


def _session() -> dict[str, Any]:
    """A whole transfer of BLOB in chunks of CHUNK bytes, frame by frame."""
    frames = [
        {"from": "client", "frame_hex": encode_frame(header(Describe(stage=1, step=40))).hex()},
        {
            "from": "holder",
            "frame_hex": encode_frame(
                header(Info(stage=1, step=40, size=len(BLOB), sha256=SHA, chunk=CHUNK))
            ).hex(),
        },
    ]
    for offset, length in chunk_plan(len(BLOB), 0, CHUNK):
        frames.append(
            {
                "from": "client",
                "frame_hex": encode_frame(
                    header(ChunkRequest(stage=1, step=40, offset=offset, length=length))
                ).hex(),
            }
        )
        reply = header(Data(stage=1, step=40, offset=offset, length=length))
        frames.append(
            {"from": "holder", "frame_hex": encode_frame(reply, BLOB[offset : offset + length]).hex()}
        )
    return {
        "type": "session",
        "description": f"the whole {len(BLOB)}-byte blob of stage 1 step 40 in chunks of {CHUNK} bytes",
        "blob_hex": BLOB.hex(),
        "sha256_hex": SHA.hex(),
        "chunk": CHUNK,
        "frames": frames,
    }


def generate() -> dict[str, dict[str, Any]]:
    info = header(Info(stage=1, step=40, size=len(BLOB), sha256=SHA, chunk=CHUNK))
    chunk = header(ChunkRequest(stage=1, step=40, offset=16, length=16))
    data = header(Data(stage=1, step=40, offset=16, length=16))
    out = {
        "valid-describe": _frame(
            "request", "what is the blob of stage 1 at step 40?", header(Describe(stage=1, step=40))
        ),
        "valid-info": _frame("reply", "37 bytes, their sha256, chunks of at most 16 bytes", info),
        "valid-chunk": _frame("request", "bytes [16, 32) of the described blob", chunk),
        "valid-data": _frame("reply", "bytes [16, 32) as the payload", data, BLOB[16:32]),
        "valid-info-unknown-field": _frame(
            "reply",
            "an unknown field is ignored (tolerant within v1)",
            info | {"zone": "eu"},
            decode_only=True,
        ),
        "valid-error-busy": _frame(
            "reply",
            "the holder's session budget is spent",
            error_header(ErrorCode.BUSY, "state holder busy: 8 sessions (at most 8)"),
            error="BUSY",
        ),
        "valid-error-not-held": _frame(
            "reply",
            "the holder has no state of that stage and step",
            error_header(ErrorCode.WRONG_STEP, "this peer holds no state of stage 1 at step 41"),
            error="WRONG_STEP",
        ),
        "session-37-bytes": _session(),
    }
    bad = {
        "bad-version": ("reply", info | {"v": 2}, b"", "UNSUPPORTED_VERSION", "state.info of version 2"),
        "bad-kind": (
            "request",
            chunk | {"kind": "state.push"},
            b"",
            "UNKNOWN_KIND",
            "a kind v1 does not define",
        ),
        "bad-reply-as-request": ("request", info, b"", "UNKNOWN_KIND", "a reply kind sent to the holder"),
        "bad-hash-length": ("reply", info | {"sha256": SHA[:20]}, b"", "MALFORMED", "a 20-byte sha256"),
        "bad-hash-as-text": (
            "reply",
            info | {"sha256": SHA.hex()},
            b"",
            "MALFORMED",
            "the sha256 as hex text",
        ),
        "bad-chunk-zero": ("reply", info | {"chunk": 0}, b"", "MALFORMED", "a holder serving 0-byte chunks"),
        "bad-missing-size": (
            "reply",
            {k: v for k, v in info.items() if k != "size"},
            b"",
            "MALFORMED",
            "no size",
        ),
        "bad-length-zero": ("request", chunk | {"length": 0}, b"", "MALFORMED", "an empty chunk request"),
        "bad-offset-negative": ("request", chunk | {"offset": -16}, b"", "MALFORMED", "a negative offset"),
        "bad-step-bool": ("request", chunk | {"step": True}, b"", "MALFORMED", "step as a bool"),
        "bad-request-payload": ("request", chunk, b"x", "OVERSIZED", "a request with a payload"),
        "bad-data-over-chunk": (
            "reply",
            data,
            bytes(17),
            "OVERSIZED",
            "17 payload bytes to a 16-byte client",
        ),
    }
    for name, (side, head, payload, code, desc) in bad.items():
        out[name] = {
            "type": "invalid",
            "side": side,
            "description": desc,
            "frame_hex": encode_frame(head, payload).hex(),
            "error": code,
        }
    return out


# ---------------------------------------------------------------- tests


def test_vector_set_is_complete():
    names = {p.stem for p in VECTORS.glob("*.json")}
    assert {"valid-describe", "valid-info", "valid-chunk", "valid-data", "session-37-bytes"} <= names
    codes = {_load(p)["error"] for p in _files("invalid")}
    assert {"UNSUPPORTED_VERSION", "UNKNOWN_KIND", "MALFORMED", "OVERSIZED"} <= codes


def test_vectors_are_what_the_encoder_writes():
    expected = generate()
    assert {p.stem for p in VECTORS.glob("*.json")} == set(expected)
    for name, case in expected.items():
        assert _load(VECTORS / f"{name}.json") == case, name


@pytest.mark.parametrize("path", _files("frame"), ids=lambda p: p.stem)
def test_frame_vectors_decode_and_reencode_byte_exact(path: Path):
    case = _load(path)
    frame, payload = bytes.fromhex(case["frame_hex"]), bytes.fromhex(case["payload_hex"])
    got_header, got_payload, wire = _decode(frame, _limits(case["side"]))
    assert wire == len(frame) and bytes(got_payload) == payload
    if "error" in case:
        assert got_header["code"] == ErrorCode[case["error"]]
        return
    msg = parse(got_header, _kinds(case["side"]))
    again = encode_frame(header(msg), payload)
    if case.get("decode_only"):
        assert again != frame and msg == parse(_decode(again, _limits(case["side"]))[0], _kinds(case["side"]))
    else:
        assert again == frame and encode_frame(_wire_header(case["header"]), payload) == frame
        # the same bytes from the spec's encoding rules alone, not from peerd's encoder
        raw = canonical_msgpack.canonical(case["header"])
        assert encode_prefix(len(raw), len(payload)) + raw + payload == frame


@pytest.mark.parametrize("path", _files("invalid"), ids=lambda p: p.stem)
def test_invalid_vectors_are_rejected_with_their_code(path: Path):
    case = _load(path)
    with pytest.raises(PeerdError) as info:
        got_header, _, _ = _decode(bytes.fromhex(case["frame_hex"]), _limits(case["side"]))
        parse(got_header, _kinds(case["side"]))
    assert info.value.code == ErrorCode[case["error"]]


def test_session_vector_assembles_the_blob_it_describes():
    case = _load(VECTORS / "session-37-bytes.json")
    blob = bytes.fromhex(case["blob_hex"])
    assert hashlib.sha256(blob).hexdigest() == case["sha256_hex"]
    received = b""
    described: Info | None = None
    for i, step in enumerate(case["frames"]):
        side = "request" if step["from"] == "client" else "reply"
        assert side == ("request" if i % 2 == 0 else "reply")  # strictly request, answer, request, ...
        head, payload, _ = _decode(bytes.fromhex(step["frame_hex"]), _limits(side))
        msg = parse(head, _kinds(side))
        if isinstance(msg, Info):
            described = msg
        elif isinstance(msg, Data):
            assert msg.offset == len(received) and msg.length == len(payload) <= case["chunk"]
            received += payload
    assert (
        described is not None and described.size == len(blob) and described.sha256.hex() == case["sha256_hex"]
    )
    assert received == blob


if __name__ == "__main__" and "--write" in sys.argv:
    VECTORS.mkdir(parents=True, exist_ok=True)
    for old in VECTORS.glob("*.json"):
        old.unlink()
    for name, case in generate().items():
        (VECTORS / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")
    print(f"wrote {len(list(VECTORS.glob('*.json')))} vectors to {VECTORS}")
