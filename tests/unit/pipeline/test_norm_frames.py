"""Norm frames against the byte-exact vectors in protocols/vectors/pipeline_norm/, and what a stage refuses."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import KIND_NORM_PART, check_message, norm_expectation, parse_part, part_header
from peerd.swarm.framing import encode_frame

VECTORS = sorted(
    (Path(__file__).resolve().parents[3] / "protocols" / "vectors" / "pipeline_norm").glob("*.json")
)


def _bytes(frame) -> bytes:
    return b"".join(bytes(x) for x in frame) if isinstance(frame, list | tuple) else bytes(frame)


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_norm_vectors_encode_and_decode_exactly(path: Path):
    case = json.loads(path.read_text())
    (frame,) = case["frames"]
    payload = bytes.fromhex(frame["payload_hex"])
    assert _bytes(encode_frame(frame["header"], payload)).hex() == frame["frame_hex"]
    part = parse_part(frame["header"])
    e = case["expect"]
    check_message(part.message, norm_expectation(e["job"], e["kind"], e["boundary"], e["step"]))
    assert part_header(part.message) == frame["header"]
    value = RawDecoder().decode(part.message, bytearray(payload))
    assert value.tolist() == [case["value"]] and struct.unpack("<d", payload)[0] == case["value"]


def test_a_stage_refuses_malformed_norm_frames_with_the_codes_of_the_spec():
    case = json.loads(VECTORS[0].read_text())
    header = case["frames"][0]["header"]
    expect = norm_expectation("job-7", KIND_NORM_PART, 1, 5)
    bad = {
        ErrorCode.WRONG_STEP: [{"mb": 1}, {"step": 7}],
        ErrorCode.UNKNOWN_EXAMPLE: [{"ids": [3]}],
        ErrorCode.DTYPE_MISMATCH: [{"dtype": "float32", "nbytes": 4}],
        ErrorCode.SHAPE_MISMATCH: [{"shape": [2], "nbytes": 16}],
        ErrorCode.NOT_ALLOWED: [{"kind": "pp.norm.total"}],
        ErrorCode.MALFORMED: [{"b": 0}],
    }
    for code, changes in bad.items():
        for change in changes:
            msg = parse_part({**header, **change}).message
            with pytest.raises(ProtocolError) as info:
                check_message(msg, expect)
            assert info.value.code == code, change
    msg = parse_part(header).message
    with pytest.raises(ProtocolError) as info:
        RawDecoder().decode(msg, bytearray(struct.pack("<d", float("inf"))))
    assert info.value.code == ErrorCode.NON_FINITE
