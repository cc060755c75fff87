"""Frame and packet parsing: every cut and every flipped byte gives a typed CodecError, never garbage or a crash."""

from __future__ import annotations

import random

import pytest
import torch

from peerd.compress import DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig, make_codec
from peerd.compress.wire import FrameHeader, build_packet, parse_frame, parse_packet
from peerd.errors import CodecError, ErrorCode


def _frames() -> dict[str, bytes]:
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    return {
        "q3": make_codec("q3").encode(x)[0],
        "q4-group-ids": make_codec("q4", QuantConfig(layout="group", group_size=16)).encode(x, ids=range(6))[
            0
        ],
        "bf16-seed": make_codec("bf16").encode(x, ids=range(6), seed=True)[0],
    }


@pytest.mark.parametrize("name", ["q3", "q4-group-ids", "bf16-seed"])
def test_every_truncation_is_truncated(name: str):
    data = _frames()[name]
    for cut in range(len(data)):
        with pytest.raises(CodecError) as info:
            parse_frame(data[:cut])
        assert info.value.code == ErrorCode.TRUNCATED, cut


@pytest.mark.parametrize("name", ["q3", "q4-group-ids", "bf16-seed"])
def test_random_corruption_never_escapes_as_another_exception(name: str):
    data = _frames()[name]
    rng = random.Random(1)
    codec = make_codec("fp32")
    for _ in range(300):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(0, min(len(bad), 60))  # the header and scales, where structure lives
            bad[pos] = rng.randrange(256)
        try:
            out = codec.decode(bytes(bad))
        except CodecError:
            continue
        assert bool(torch.isfinite(out.float()).all())  # accepted: a well-formed frame, finite values


def test_header_round_trip_and_sizes():
    h = FrameHeader(
        codec=2, bits=3, dtype=torch.float16, aux_dtype=torch.bfloat16, shape=(2, 5, 7), ids=(9, 2**63),
        symmetric=True, layout="group", group_size=8,
    )  # fmt: skip
    assert h.n_scales == 9 and h.payload_nbytes == 3 * 9 and h.head_nbytes == 20 + 12 + 16
    x = torch.randn(2, 5, 7).half()
    codec = make_codec("q3", QuantConfig(layout="group", group_size=8))
    data, _ = codec.encode(x, ids=[9, 2**63])
    got = parse_frame(data).header
    assert (got.codec, got.bits, got.dtype, got.aux_dtype, got.shape, got.ids, got.symmetric, got.seed) == (
        2, 3, torch.float16, torch.bfloat16, (2, 5, 7), (9, 2**63), True, False,
    )  # fmt: skip
    assert len(data) == got.nbytes


def test_ids_must_fit_and_be_distinct():
    with pytest.raises(CodecError) as info:
        make_codec("fp32").encode(torch.ones(2, 2), ids=[-1, 3])
    assert info.value.code == ErrorCode.MALFORMED
    data = bytearray(make_codec("fp32").encode(torch.ones(2, 2), ids=[4, 5])[0])
    data[28:36] = data[36:44]  # duplicate id
    with pytest.raises(CodecError) as info:
        parse_frame(bytes(data))
    assert info.value.code == ErrorCode.MALFORMED


def test_packet_structure_errors():
    enc = DeltaEncoder(DeltaConfig())
    packet = enc.encode(torch.randn(2, 3, 4), [1, 2])
    ids, frames = parse_packet(packet)
    assert ids == (1, 2) and len(frames) == 1
    for cut in range(len(packet)):
        with pytest.raises(CodecError) as info:
            parse_packet(packet[:cut])
        assert info.value.code in (ErrorCode.TRUNCATED, ErrorCode.MALFORMED), cut
    with pytest.raises(CodecError) as info:
        parse_packet(packet + b"\x00")
    assert info.value.code == ErrorCode.MALFORMED
    frame = make_codec("fp32").encode(torch.ones(1, 2), ids=[1], seed=True)[0]
    for frames_ in ([], [frame] * 4):
        with pytest.raises(CodecError):
            build_packet(type("P", (), {"ids": (1,), "frames": frames_})())  # type: ignore[arg-type]
    dup = build_packet(type("P", (), {"ids": (1, 1), "frames": [frame]})())  # type: ignore[arg-type]
    with pytest.raises(CodecError) as info:
        parse_packet(dup)
    assert info.value.code == ErrorCode.MALFORMED


def test_packet_frames_must_agree():
    a = make_codec("fp32").encode(torch.ones(1, 2), ids=[1], seed=True)[0]
    b = make_codec("fp32").encode(torch.ones(1, 2).half(), ids=[2], seed=True)[0]
    c = make_codec("fp32").encode(torch.ones(1, 3), ids=[2], seed=True)[0]
    P = type("P", (), {})
    for other, code in ((b, ErrorCode.DTYPE_MISMATCH), (c, ErrorCode.SHAPE_MISMATCH)):
        p = P()
        p.ids, p.frames = (1, 2), [a, other]
        with pytest.raises(CodecError) as info:
            DeltaDecoder(DeltaConfig()).decode(build_packet(p))  # type: ignore[arg-type]
        assert info.value.code == code
