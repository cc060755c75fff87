"""Pipeline frames against the byte-exact vectors in protocols/vectors/pipeline/ (encode, decode, errors by code)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.errors import ErrorCode, PeerdError
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import (
    CONTROL_KINDS,
    DTYPES,
    Abort,
    Ack,
    Assembler,
    Expectation,
    Hello,
    Nack,
    TensorMessage,
    check_message,
    control_header,
    parse_control,
    parse_part,
    part_header,
)
from peerd.swarm.framing import encode_frame, read_frame

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "pipeline"
FILES = sorted(VECTORS.glob("*.json"))
VALID = [f for f in FILES if f.name.startswith("valid-")]
INVALID = [f for f in FILES if f.name.startswith("invalid-")]


def _read(raw: bytes) -> tuple[dict, bytearray]:
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        header, payload, wire = await read_frame(reader, timeout=1.0)
        assert wire == len(raw)
        return header, payload

    return asyncio.run(go())


def _expectation(spec: dict[str, Any]) -> Expectation:
    micro = {int(step): [list(ids) for ids in mbs] for step, mbs in spec["micro_batches"].items()}

    def ids_of(step: int, mb: int) -> list[int] | None:
        mbs = micro.get(step, [])
        return mbs[mb] if 0 <= mb < len(mbs) else None

    return Expectation(
        job=spec["job"],
        kind=spec["kind"],
        boundary=spec["boundary"],
        codec=spec["codec"],
        dtype=spec["dtype"],
        row_shape=tuple(spec["row_shape"]),
        steps=tuple(spec["steps"]),  # type: ignore[arg-type]
        ids_of=ids_of,
    )


def _schema_header(header: dict[str, Any]) -> dict[str, Any]:
    """``header`` read into its schema and written back."""
    if header["kind"] in CONTROL_KINDS:
        return control_header(parse_control(header))
    part = parse_part(header)
    return part_header(part.message, part.index, part.count, part.offset)


def _decode(frames: list[bytes], expect: dict[str, Any]) -> tuple[TensorMessage, torch.Tensor | None]:
    """What a stage's receiver does with these frames, in its order of checks."""
    expectation = _expectation(expect)
    assembler = Assembler()
    done = None
    for raw in frames:
        header, payload = _read(raw)
        part = parse_part(header)
        if part.index == 0:
            check_message(part.message, expectation)
        done = assembler.feed(part, payload)
    assert done is not None, "the frames did not complete a message"
    msg, buf = done
    tensor = RawDecoder().decode(msg, buf) if msg.codec == "none" else None
    return msg, tensor


def test_vector_set_is_complete():
    assert len(VALID) >= 8 and len(INVALID) >= 20
    codes = {json.loads(f.read_text())["error"] for f in INVALID}
    assert {
        "WRONG_STEP",
        "UNKNOWN_EXAMPLE",
        "SHAPE_MISMATCH",
        "TRUNCATED",
        "MALFORMED",
        "NOT_ALLOWED",
        "UNKNOWN_CODEC",
        "DTYPE_MISMATCH",
    } <= codes


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_vector(path: Path):
    case = json.loads(path.read_text())
    frames = [bytes.fromhex(f["frame_hex"]) for f in case["frames"]]
    for f, raw in zip(case["frames"], frames, strict=True):
        header, payload = _read(raw)
        assert header == f["header"] and bytes(payload) == bytes.fromhex(f["payload_hex"])
        if not case.get("decode_only"):
            assert encode_frame(f["header"], payload) == raw
            assert encode_frame(_schema_header(header), payload) == raw  # the typed header, byte-exact
    first = case["frames"][0]["header"]
    if first["kind"] in CONTROL_KINDS:
        ctl = parse_control(first)
        assert isinstance(ctl, Ack | Nack | Abort | Hello)
        if isinstance(ctl, Hello):
            assert ctl.epoch == first["epoch"]
        elif not isinstance(ctl, Ack):
            assert ctl.code == ErrorCode(first["code"]) and ctl.message == first["message"]
        return
    msg, tensor = _decode(frames, case["expect"])
    # the message's metadata re-encodes to the first part's header (minus unknown fields)
    known = {k: v for k, v in first.items() if k in part_header(msg)}
    assert part_header(msg, 0, first["parts"], 0) == known
    assert sum(len(bytes.fromhex(f["payload_hex"])) for f in case["frames"]) == msg.nbytes
    if "tensor" in case:
        want = case["tensor"]
        assert tensor is not None and tensor.dtype == DTYPES[want["dtype"]]
        assert list(tensor.shape) == want["shape"]
        assert tensor.flatten().tolist() == want["values"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_vector_is_rejected_with_its_code(path: Path):
    case = json.loads(path.read_text())
    with pytest.raises(PeerdError) as info:
        _decode([bytes.fromhex(h) for h in case["frames_hex"]], case["expect"])
    assert info.value.code == ErrorCode[case["error"]], str(info.value)
