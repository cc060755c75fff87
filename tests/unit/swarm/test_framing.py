"""Frame codec: incremental reads from a StreamReader, limits, timeouts, zero-copy writes, error frames."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.swarm.framing import (
    PREFIX_LEN,
    FrameLimits,
    StreamClosed,
    encode_frame,
    encode_header,
    error_from_header,
    error_header,
    read_frame,
    write_frame,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_round_trip_keeps_header_types_and_payload():
    header = {
        "kind": "act",
        "step": 3,
        "scale": 0.125,
        "shape": [4, 8],
        "ok": True,
        "none": None,
        "raw": b"\x01",
    }
    payload = bytes(range(256)) * 3

    async def go():
        return await read_frame(reader_with(encode_frame(header, payload)))

    got, body, wire = run(go())
    assert got == header
    assert isinstance(body, bytearray) and body == payload
    assert wire == len(encode_frame(header, payload))


def test_header_encoding_is_canonical():
    assert encode_header({"seq": 1, "kind": "x", "m": {"b": 1, "a": 2}}) == encode_header(
        {"kind": "x", "m": {"a": 2, "b": 1}, "seq": 1}
    )
    assert encode_header({"kind": "x", "t": (1, 2)}) == encode_header({"kind": "x", "t": [1, 2]})


@pytest.mark.parametrize(
    "header", [{}, {"kind": ""}, {"kind": 3}, {"kind": "x", "v": object()}, {"kind": "x", "m": {1: 2}}]
)
def test_unencodable_headers_are_refused(header):
    with pytest.raises(ProtocolError) as info:
        encode_frame(header)
    assert info.value.code == ErrorCode.MALFORMED


def test_frames_decode_when_bytes_trickle_in():
    frames = [({"kind": "a", "i": i}, bytes([i]) * (i * 1000)) for i in range(5)]
    data = b"".join(encode_frame(h, p) for h, p in frames)

    async def go():
        reader = asyncio.StreamReader()

        async def feed():
            for offset in range(0, len(data), 777):
                reader.feed_data(data[offset : offset + 777])
                await asyncio.sleep(0)
            reader.feed_eof()

        feeder = asyncio.create_task(feed())
        got = [await read_frame(reader, limits=FrameLimits(chunk=1000)) for _ in frames]
        with pytest.raises(StreamClosed):
            await read_frame(reader)
        await feeder
        return got

    got = run(go())
    assert [(h, bytes(p)) for h, p, _ in got] == frames


def test_oversized_payload_is_refused_before_the_body_arrives():
    head = struct.pack(">2sBBIQ", b"PD", 1, 0, 3, 10_000) + msgpack.packb({"kind": "x"})[:3]

    async def go():
        # no EOF and no body: the limit check must not wait for bytes that may never come
        await read_frame(reader_with(head, eof=False), limits=FrameLimits(max_payload=9_999), timeout=5)

    with pytest.raises(ProtocolError) as info:
        run(go())
    assert info.value.code == ErrorCode.OVERSIZED


@pytest.mark.parametrize(("eof", "code"), [(True, ErrorCode.TRUNCATED), (False, ErrorCode.TIMEOUT)])
def test_a_payload_announced_but_not_sent_allocates_nothing(eof: bool, code: ErrorCode):
    """The 58-byte attack: a frame that declares 1 GiB, sends 1 kB of it, then ends or goes quiet."""
    header = msgpack.packb({"kind": "probe"})
    head = struct.pack(">2sBBIQ", b"PD", 1, 0, len(header), 1 << 30) + header + bytes(1000)

    async def go() -> tuple[PeerdError | None, int]:
        tracemalloc.start()
        try:
            await read_frame(reader_with(head, eof=eof), limits=FrameLimits(max_payload=1 << 30), timeout=0.2)
        except PeerdError as exc:
            return exc, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return None, 0

    error, peak = run(go())
    assert error is not None and error.code == code
    assert peak < 1 << 20  # only what arrived, not the announced 1 GiB


def test_timeout_waiting_for_a_frame_is_typed():
    async def go():
        await read_frame(reader_with(b"", eof=False), timeout=0.05)

    with pytest.raises(PeerUnavailable) as info:
        run(go())
    assert info.value.code == ErrorCode.TIMEOUT


def test_stall_inside_a_payload_times_out():
    frame = encode_frame({"kind": "x"}, bytes(100))

    async def go():
        await read_frame(reader_with(frame[:-40], eof=False), timeout=0.05)

    with pytest.raises(PeerUnavailable) as info:
        run(go())
    assert info.value.code == ErrorCode.TIMEOUT


def test_write_frame_hands_payload_slices_without_copying():
    payload = np.arange(100_000, dtype=np.float32)  # 400 kB
    seen: list[memoryview] = []

    async def write(chunk: memoryview) -> None:
        seen.append(chunk)

    wire = run(write_frame(write, {"kind": "t", "shape": [100_000]}, memoryview(payload), chunk=64 * 1024))
    head, *body = seen
    assert wire == sum(c.nbytes for c in seen)
    assert all(c.obj is payload for c in body)  # views into the caller's array, not copies
    assert b"".join(bytes(c) for c in body) == payload.tobytes()
    assert bytes(head)[:2] == b"PD" and len(body) == 7


def test_small_frames_go_out_in_one_write():
    seen = []

    async def write(chunk: memoryview) -> None:
        seen.append(bytes(chunk))

    run(write_frame(write, {"kind": "p"}, b"abc"))
    assert seen == [encode_frame({"kind": "p"}, b"abc")]
    assert len(seen[0]) == PREFIX_LEN + len(encode_header({"kind": "p"})) + 3


@pytest.mark.parametrize(
    "code, cls",
    [
        (ErrorCode.NOT_ALLOWED, ProtocolError),
        (ErrorCode.WRONG_STEP, ProtocolError),
        (ErrorCode.BUSY, PeerUnavailable),
        (ErrorCode.TIMEOUT, PeerUnavailable),
        (ErrorCode.INTERNAL, PeerdError),
    ],
)
def test_error_frames_map_to_typed_errors(code, cls):
    err = error_from_header(error_header(code, "why"))
    assert type(err) is cls and err.code == code and "why" in str(err)


@pytest.mark.parametrize("raw_code", [12345, "300", None, 300.0, [300]])
def test_error_frame_with_unknown_or_non_integer_code_is_malformed(raw_code):
    err = error_from_header({"kind": "error", "code": raw_code, "message": "?"})
    assert type(err) is ProtocolError and err.code == ErrorCode.MALFORMED
