"""The frame codec against the byte-exact vectors in protocols/vectors/transport/ (encode and decode, errors by code)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from peerd.errors import ErrorCode, PeerdError
from peerd.swarm.framing import StreamClosed, encode_frame, read_frame

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "transport"
FILES = sorted(VECTORS.glob("*.json"))
VALID = [f for f in FILES if "error" not in json.loads(f.read_text())]
INVALID = [f for f in FILES if "error" in json.loads(f.read_text())]


def _decode(data: bytes):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        result = await read_frame(reader, timeout=1.0)
        # exactly one frame: what follows is a clean end of stream
        with pytest.raises(StreamClosed):
            await read_frame(reader, timeout=1.0)
        return result

    return asyncio.run(go())


def test_vector_set_is_complete():
    assert len(VALID) >= 5 and len(INVALID) >= 10
    codes = {json.loads(f.read_text())["error"] for f in INVALID}
    assert {"MALFORMED", "OVERSIZED", "TRUNCATED", "UNSUPPORTED_VERSION"} <= codes


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_vector_round_trips(path: Path):
    case = json.loads(path.read_text())
    frame = bytes.fromhex(case["frame_hex"])
    payload = bytes.fromhex(case["payload_hex"])
    if not case.get("decode_only"):
        assert encode_frame(case["header"], payload) == frame
    header, got_payload, wire = _decode(frame)
    assert header == case["header"]
    assert bytes(got_payload) == payload
    assert wire == len(frame)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_malformed_vector_is_rejected_with_its_code(path: Path):
    case = json.loads(path.read_text())
    with pytest.raises(PeerdError) as info:
        _decode(bytes.fromhex(case["frame_hex"]))
    assert info.value.code == ErrorCode[case["error"]]
