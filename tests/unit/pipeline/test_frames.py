"""Pipeline frames: header schema, part reassembly, expectations, control frames, raw tensor payloads."""

from __future__ import annotations

import msgspec
import pytest
import torch

from peerd.errors import ErrorCode, ProtocolError
from peerd.pipeline.frames import (
    KIND_ACT,
    KIND_GRAD,
    Abort,
    Ack,
    Assembler,
    Expectation,
    Nack,
    Part,
    TensorMessage,
    check_message,
    control_header,
    parse_control,
    parse_part,
    part_header,
    part_spans,
    raw_payload,
    raw_tensor,
)

ACTS = torch.randn(2, 4, 8)
MSG = TensorMessage(KIND_ACT, "j", 3, 1, 0, (5, 9), "none", (2, 4, 8), "float32", 0, ACTS.numel() * 4)
MICRO = {3: [[1, 2], [5, 9]], 4: [[7, 8], [3, 4]]}


def expect(**kw) -> Expectation:
    base = dict(
        job="j",
        kind=KIND_ACT,
        boundary=0,
        codec="none",
        dtype="float32",
        row_shape=(4, 8),
        steps=(3, 4),
        ids_of=lambda s, mb: MICRO[s][mb] if s in MICRO and 0 <= mb < len(MICRO[s]) else None,
    )
    return Expectation(**{**base, **kw})


def code_of(fn, *args) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    return info.value.code


def test_raw_payload_round_trips_bit_exactly_without_copy():
    payload = bytearray(raw_payload(ACTS))
    back = raw_tensor(MSG, payload)
    assert torch.equal(back, ACTS)
    back[0, 0, 0] = 123.0  # a view of the received buffer, not a copy
    assert torch.frombuffer(payload, dtype=torch.float32)[0] == 123.0


def test_raw_tensor_rejects_a_payload_that_does_not_fit_the_shape():
    assert code_of(raw_tensor, MSG, bytearray(10)) == ErrorCode.SHAPE_MISMATCH
    empty = msgspec.structs.replace(MSG, shape=(0, 4, 8), nbytes=0, ids=())
    assert raw_tensor(empty, bytearray()).shape == (0, 4, 8)


def test_part_header_parses_back_to_the_same_message():
    for index, count, off in ((0, 1, 0), (2, 3, 64)):
        part = parse_part(part_header(MSG, index, count, off))
        assert part == Part(MSG, index, count, off)


@pytest.mark.parametrize(
    "change, code",
    [
        ({"kind": "pp.x"}, ErrorCode.UNKNOWN_KIND),
        ({"v": 2}, ErrorCode.UNSUPPORTED_VERSION),
        ({"v": "1"}, ErrorCode.MALFORMED),
        ({"dtype": "int64"}, ErrorCode.DTYPE_MISMATCH),
        ({"step": -1}, ErrorCode.MALFORMED),
        ({"step": 1.0}, ErrorCode.MALFORMED),
        ({"ids": [1, "2"]}, ErrorCode.MALFORMED),
        ({"ids": [1, 1]}, ErrorCode.MALFORMED),
        ({"ids": list(range(70_000))}, ErrorCode.MALFORMED),
        ({"shape": [1] * 9}, ErrorCode.MALFORMED),
        ({"job": ""}, ErrorCode.MALFORMED),
        ({"job": "x" * 300}, ErrorCode.MALFORMED),
        ({"parts": 0}, ErrorCode.MALFORMED),
        ({"part": 1, "parts": 1}, ErrorCode.MALFORMED),
        ({"off": MSG.nbytes + 1}, ErrorCode.MALFORMED),
        ({"seq": None}, ErrorCode.MALFORMED),
    ],
)
def test_schema_errors_have_their_codes(change, code):
    header = {**part_header(MSG), **change}
    assert code_of(parse_part, header) == code


def test_assembler_joins_parts_in_order_and_resets_after_errors():
    payload = bytes(raw_payload(ACTS))
    spans = part_spans(len(payload), 100)
    assert [n for _, n in spans] == [100, 100, 56] and part_spans(0, 100) == [(0, 0)]
    asm = Assembler()
    out = None
    for i, (off, n) in enumerate(spans):
        assert out is None
        out = asm.feed(Part(MSG, i, len(spans), off), memoryview(payload)[off : off + n])
    assert out is not None and out[0] == MSG and bytes(out[1]) == payload and not asm.busy
    # a part of another message in the middle: MALFORMED, and the next message starts clean
    asm.feed(Part(MSG, 0, 3, 0), payload[:100])
    other = msgspec.structs.replace(MSG, seq=1)
    assert code_of(asm.feed, Part(other, 1, 3, 100), payload[100:200]) == ErrorCode.MALFORMED
    assert not asm.busy
    assert asm.feed(Part(MSG, 0, 1, 0), bytearray(payload))[1] == bytearray(payload)


def test_assembler_enforces_its_byte_limit():
    asm = Assembler(max_bytes=64)
    assert code_of(asm.feed, Part(MSG, 0, 2, 0), bytes(32)) == ErrorCode.OVERSIZED


def test_expectation_checks_in_order():
    ok = msgspec.structs.replace(MSG)
    check_message(ok, expect())
    check_message(msgspec.structs.replace(MSG, step=4, mb=0, ids=(7, 8)), expect())  # the next step is fine
    cases = [
        (dict(kind=KIND_GRAD), ErrorCode.NOT_ALLOWED),
        (dict(job="k"), ErrorCode.NOT_ALLOWED),
        (dict(boundary=1), ErrorCode.MALFORMED),
        (dict(step=5), ErrorCode.WRONG_STEP),
        (dict(step=2), ErrorCode.WRONG_STEP),
        (dict(mb=2), ErrorCode.WRONG_STEP),
        (dict(ids=(5, 10)), ErrorCode.UNKNOWN_EXAMPLE),
        (dict(ids=(9, 5)), ErrorCode.UNKNOWN_EXAMPLE),
        (dict(dtype="float16"), ErrorCode.DTYPE_MISMATCH),
        (dict(shape=(2, 4, 9)), ErrorCode.SHAPE_MISMATCH),
        (dict(codec="q8"), ErrorCode.UNKNOWN_CODEC),
        (dict(nbytes=MSG.nbytes - 4), ErrorCode.SHAPE_MISMATCH),
    ]
    for change, code in cases:
        assert code_of(check_message, msgspec.structs.replace(MSG, **change), expect()) == code, change
    compressed = expect(codec="acsgd-q4")
    check_message(msgspec.structs.replace(MSG, codec="acsgd-q4", nbytes=100), compressed)
    huge = msgspec.structs.replace(MSG, codec="acsgd-q4", nbytes=MSG.nbytes + 4096 + 64 + 1)
    assert code_of(check_message, huge, compressed) == ErrorCode.OVERSIZED


def test_control_frames_round_trip_and_reject_garbage():
    assert control_header(Ack(4)) == {"kind": "pp.ack", "v": 1, "seq": 4}
    assert parse_control(control_header(Ack(4))) == Ack(4)
    assert parse_control(control_header(Nack(-1, ErrorCode.WRONG_STEP, "x" * 5000))) == Nack(
        -1, ErrorCode.WRONG_STEP, "x" * 1000
    )
    abort = Abort(7, ErrorCode.TIMEOUT, "late")
    assert parse_control(control_header(abort)) == abort
    assert code_of(parse_control, {"kind": "pp.act", "v": 1}) == ErrorCode.UNKNOWN_KIND
    nack = control_header(Nack(1, ErrorCode.MALFORMED, "m"))
    assert code_of(parse_control, {**nack, "code": 12345}) == ErrorCode.MALFORMED
    assert code_of(parse_control, {**nack, "message": "x" * 1001}) == ErrorCode.MALFORMED
    assert code_of(parse_control, {**control_header(Ack(1)), "seq": -1}) == ErrorCode.MALFORMED
    assert code_of(parse_control, {**control_header(Ack(1)), "v": 9}) == ErrorCode.UNSUPPORTED_VERSION
    assert code_of(parse_control, {**control_header(Ack(1)), "seq": True}) == ErrorCode.MALFORMED


def test_a_resend_is_checked_without_its_step_and_assembled_without_a_buffer():
    old = msgspec.structs.replace(MSG, step=1, mb=0, ids=(7, 8))  # step 1 is over, its ids unknown
    check_message(old, expect(), accepted=True)
    assert code_of(check_message, old, expect()) == ErrorCode.WRONG_STEP
    big = msgspec.structs.replace(old, nbytes=MSG.nbytes * 2)
    assert code_of(lambda: check_message(big, expect(), accepted=True)) == ErrorCode.SHAPE_MISMATCH
    asm = Assembler()
    huge = msgspec.structs.replace(MSG, nbytes=1 << 31)
    assert asm.feed(Part(huge, 0, 2, 0), bytes(8), keep=False) is None
    assert len(asm._buf) == 0 and asm.busy  # nothing allocated for the 2 GiB it announces
    assert code_of(asm.feed, Part(huge, 1, 2, 8), bytes(8)) == ErrorCode.TRUNCATED
