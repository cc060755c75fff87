"""Wire framing for peerd streams: a 16-byte prefix, a msgpack header and a raw payload (protocols/transport.md).

Frame layout (all integers big-endian)::

    offset size  field
    0      2     magic  b"PD"
    2      1     version (1)
    3      1     flags (reserved: senders write 0, receivers ignore)
    4      4     header_len  (u32) length of the msgpack header
    8      8     payload_len (u64) length of the raw payload
    16     H     header: msgpack map with str keys, at least {"kind": str}
    16+H   P     payload: opaque bytes

This module is pure except for ``read_frame``/``write_frame``, which move frames over
asyncio streams incrementally, with size limits and timeouts, and never build a copy of
a large payload on the sending side (memoryview slices are written as they are).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.wire import canonical_pack, decode_map

MAGIC = b"PD"
VERSION = 1
PREFIX = struct.Struct(">2sBBIQ")
PREFIX_LEN = PREFIX.size  # 16
ERROR_KIND = "error"

# Codes that describe the remote peer or time rather than the bytes: raised as PeerUnavailable.
_UNAVAILABLE_CODES = frozenset(
    {ErrorCode.PEER_UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.BANNED}
)

Header = dict[str, Any]
Payload = bytes | bytearray | memoryview


class StreamClosed(PeerUnavailable):
    """The remote side closed the stream cleanly between two frames."""

    code = ErrorCode.PEER_UNAVAILABLE


@dataclass(frozen=True)
class FrameLimits:
    """Largest frame parts a reader accepts; bigger announced sizes fail with OVERSIZED before any read."""

    max_header: int = 64 * 1024
    """Largest msgpack header in bytes (headers are metadata: shapes, ids, step numbers)."""
    max_payload: int = 1 << 30
    """Largest payload in bytes (1 GiB: one activation or gradient tensor of a big stage)."""
    chunk: int = 256 * 1024
    """Read/write granularity for payloads; the unit of progress for stall timeouts."""


DEFAULT_LIMITS = FrameLimits()


# ---------------------------------------------------------------- pure encode / decode


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Canonical msgpack of a header map (keys sorted at every level); ``kind`` must be a non-empty str."""
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("frame header needs a non-empty str 'kind'", code=ErrorCode.MALFORMED)
    if not all(isinstance(k, str) for k in header):
        raise ProtocolError("frame header map keys must be str", code=ErrorCode.MALFORMED)
    return canonical_pack(header)


def encode_prefix(header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, 0, header_len, payload_len)


def frame_head(header: Mapping[str, Any], payload_len: int) -> bytes:
    """Prefix + encoded header: everything of a frame except its payload."""
    raw = encode_header(header)
    return encode_prefix(len(raw), payload_len) + raw


def encode_frame(header: Mapping[str, Any], payload: Payload = b"") -> bytes:
    """A whole frame as one bytes object (small frames, test vectors)."""
    payload = memoryview(payload).cast("B")
    return frame_head(header, payload.nbytes) + payload.tobytes()


def parse_prefix(prefix: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """Validate a 16-byte prefix; return ``(header_len, payload_len)``."""
    if len(prefix) != PREFIX_LEN:
        raise ProtocolError(
            f"frame prefix is {len(prefix)} bytes, expected {PREFIX_LEN}", code=ErrorCode.TRUNCATED
        )
    magic, version, _flags, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}", code=ErrorCode.MALFORMED)
    if version != VERSION:
        raise ProtocolError(
            f"frame version {version} not supported (speak {VERSION})", code=ErrorCode.UNSUPPORTED_VERSION
        )
    if header_len == 0:
        raise ProtocolError("frame header is empty", code=ErrorCode.MALFORMED)
    if header_len > limits.max_header:
        raise ProtocolError(
            f"frame header {header_len} B > limit {limits.max_header} B", code=ErrorCode.OVERSIZED
        )
    if payload_len > limits.max_payload:
        raise ProtocolError(
            f"frame payload {payload_len} B > limit {limits.max_payload} B", code=ErrorCode.OVERSIZED
        )
    return header_len, payload_len


def parse_header(raw: bytes) -> Header:
    """Decode a msgpack header: a map with str keys and a non-empty str ``kind``; other keys pass through."""
    header = decode_map(raw, max_bytes=len(raw), what="frame header")
    kind = header.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("frame header lacks a str 'kind'", code=ErrorCode.MALFORMED)
    return header


def error_header(code: ErrorCode | int, message: str) -> Header:
    return {"kind": ERROR_KIND, "code": int(code), "message": message[:1000]}


def error_from_header(header: Mapping[str, Any]) -> PeerdError:
    """The typed exception an ``error`` frame from the remote stands for."""
    raw_code, message = header.get("code"), header.get("message", "")
    try:
        code = ErrorCode(raw_code) if isinstance(raw_code, int) else None
    except ValueError:
        code = None
    exc: PeerdError
    if code is None:
        exc = ProtocolError(f"remote sent error frame with unknown code {raw_code!r}: {message}")
    elif code in _UNAVAILABLE_CODES:
        exc = PeerUnavailable(f"remote: {message}", code=code)
    elif code == ErrorCode.INTERNAL:
        exc = PeerdError(f"remote: {message}", code=code)
    else:
        exc = ProtocolError(f"remote: {message}", code=code)
    exc.from_remote = True
    return exc


# ---------------------------------------------------------------- streams

WriteChunk = Callable[[memoryview], Awaitable[None]]


async def _read_exactly(reader: asyncio.StreamReader, n: int, timeout: float | None, what: str) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if what == "prefix" and not exc.partial:
            raise StreamClosed("stream closed by remote") from None
        raise ProtocolError(
            f"stream ended inside frame {what} ({len(exc.partial)}/{n} B)", code=ErrorCode.TRUNCATED
        ) from None
    except TimeoutError:
        raise PeerUnavailable(f"no frame {what} within {timeout:.3g} s", code=ErrorCode.TIMEOUT) from None
    except (ConnectionError, OSError) as exc:
        raise PeerUnavailable(f"stream broke while reading frame {what}: {exc}") from None


async def read_prefix(
    reader: asyncio.StreamReader, *, limits: FrameLimits = DEFAULT_LIMITS, timeout: float | None = 30.0
) -> tuple[int, int]:
    """Wait for the next frame's prefix; return ``(header_len, payload_len)``.

    A TIMEOUT raised here consumed nothing (``readexactly`` keeps partial bytes buffered),
    so the stream stays usable; StreamClosed means the remote closed between frames.
    """
    return parse_prefix(await _read_exactly(reader, PREFIX_LEN, timeout, "prefix"), limits)


async def read_body(
    reader: asyncio.StreamReader,
    header_len: int,
    payload_len: int,
    *,
    limits: FrameLimits = DEFAULT_LIMITS,
    timeout: float | None = 30.0,
) -> tuple[Header, bytearray]:
    """Read the header and payload announced by a prefix into one buffer.

    The buffer grows with the bytes that actually arrive, never ahead of them: a peer that
    announces a 1 GiB payload and sends nothing more costs nothing (glibc grows a large
    buffer in place, so a legitimate big payload is not copied as it grows).
    """
    header = parse_header(await _read_exactly(reader, header_len, timeout, "header"))
    payload = bytearray()
    offset = 0
    while offset < payload_len:
        try:
            async with asyncio.timeout(timeout):
                chunk = await reader.read(min(limits.chunk, payload_len - offset))
        except TimeoutError:
            raise PeerUnavailable(
                f"frame payload stalled for {timeout:.3g} s at {offset}/{payload_len} B",
                code=ErrorCode.TIMEOUT,
            ) from None
        except (ConnectionError, OSError) as exc:
            raise PeerUnavailable(f"stream broke while reading frame payload: {exc}") from None
        if not chunk:
            raise ProtocolError(
                f"stream ended inside frame payload ({offset}/{payload_len} B)", code=ErrorCode.TRUNCATED
            )
        payload += chunk
        offset += len(chunk)
    return header, payload


async def read_frame(
    reader: asyncio.StreamReader, *, limits: FrameLimits = DEFAULT_LIMITS, timeout: float | None = 30.0
) -> tuple[Header, bytearray, int]:
    """Read one frame; return ``(header, payload, wire_bytes)``.

    ``timeout`` bounds the wait for the frame to start and every stall while it streams in
    (a slow link may take longer than ``timeout`` for a big payload as long as bytes keep coming).
    """
    header_len, payload_len = await read_prefix(reader, limits=limits, timeout=timeout)
    header, payload = await read_body(reader, header_len, payload_len, limits=limits, timeout=timeout)
    return header, payload, PREFIX_LEN + header_len + payload_len


async def write_frame(
    write: WriteChunk, header: Mapping[str, Any], payload: Payload = b"", *, chunk: int = DEFAULT_LIMITS.chunk
) -> int:
    """Encode and hand one frame to ``write`` piecewise (head, then payload slices); return wire bytes.

    ``write`` is an async callable taking a memoryview it must not keep after it returns
    unless it copies it (the payload belongs to the caller).
    """
    view = memoryview(payload).cast("B")
    head = frame_head(header, view.nbytes)
    if view.nbytes <= chunk:
        # one write for small frames: fewer syscalls and fewer p2pd messages
        await write(memoryview(head + view.tobytes()) if view.nbytes else memoryview(head))
    else:
        await write(memoryview(head))
        for offset in range(0, view.nbytes, chunk):
            await write(view[offset : offset + chunk])
    return len(head) + view.nbytes
