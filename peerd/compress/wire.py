"""Byte layout of compressed-tensor frames and AC-SGD packets (spec: protocols/compressed-tensor.md).

Pure parsing and building: header fields <-> bytes, with every length checked before any
tensor is allocated, so a hostile header cannot make the receiver allocate or read past the
buffer. Bad bytes raise CodecError with the ErrorCode the spec names.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field

import torch

from peerd.compress.device import to_host
from peerd.compress.packing import SUPPORTED_BITS, pack_layout
from peerd.compress.quant import n_scales
from peerd.errors import CodecError, ErrorCode

FRAME_MAGIC = b"PT"
PACKET_MAGIC = b"PK"
VERSION = 1

CODEC_RAW, CODEC_UNIFORM, CODEC_DELTA = 1, 2, 3
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_UNIFORM: "uniform", CODEC_DELTA: "delta"}

FLAG_SYMMETRIC, FLAG_SEED = 0x01, 0x02
_KNOWN_FLAGS = FLAG_SYMMETRIC | FLAG_SEED

LAYOUT_NONE, LAYOUT_CHANNEL, LAYOUT_GROUP = 0, 1, 2
LAYOUT_IDS = {"channel": LAYOUT_CHANNEL, "group": LAYOUT_GROUP}
LAYOUT_NAMES = {v: k for k, v in LAYOUT_IDS.items()}

DTYPE_IDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPES = {v: k for k, v in DTYPE_IDS.items()}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

MAX_NDIM = 8
MAX_FRAMES = 3
_HEAD = struct.Struct("<2sBBBBBBBBHII")  # magic .. n_ids: 20 bytes
_PACKET_HEAD = struct.Struct("<2sBBI")  # magic, version, n_frames, n_rows: 8 bytes


@dataclass
class FrameHeader:
    """Everything in a frame before its scales and payload."""

    codec: int
    bits: int
    dtype: torch.dtype  # the tensor's dtype (what decoding returns)
    aux_dtype: torch.dtype | None  # uniform/delta: scale type; raw: payload type
    shape: tuple[int, ...]
    ids: tuple[int, ...] = ()
    symmetric: bool = False
    seed: bool = False
    layout: str | None = None  # "channel" | "group" | None (raw)
    group_size: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_scales(self) -> int:
        if self.codec == CODEC_RAW:
            return 0
        assert self.layout is not None
        return n_scales(self.shape, self.layout, self.group_size)

    @property
    def scales_nbytes(self) -> int:
        return self.n_scales * (self.aux_dtype.itemsize if self.aux_dtype else 0)

    @property
    def payload_nbytes(self) -> int:
        if self.codec == CODEC_RAW:
            assert self.aux_dtype is not None
            return self.numel * self.aux_dtype.itemsize
        return pack_layout(self.bits, self.numel).nbytes

    @property
    def head_nbytes(self) -> int:
        return _HEAD.size + 4 * len(self.shape) + 8 * len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.head_nbytes + self.scales_nbytes + self.payload_nbytes


@dataclass
class Frame:
    header: FrameHeader
    scales: torch.Tensor | None  # float32 (n_scales,), None for raw
    payload: torch.Tensor  # uint8 view into the received bytes (read-only: never write)


@dataclass
class Packet:
    """An AC-SGD message: the micro-batch's example ids in order and 1-3 frames covering them."""

    ids: tuple[int, ...]
    frames: list[bytes] = field(default_factory=list)


def _err(msg: str, code: ErrorCode) -> CodecError:
    return CodecError(msg, code=code)


def encode_header(h: FrameHeader) -> bytes:
    flags = (FLAG_SYMMETRIC if h.symmetric else 0) | (FLAG_SEED if h.seed else 0)
    layout = LAYOUT_IDS[h.layout] if h.layout else LAYOUT_NONE
    aux = DTYPE_IDS[h.aux_dtype] if h.aux_dtype is not None else 0
    if len(h.shape) > MAX_NDIM:
        raise _err(f"at most {MAX_NDIM} dimensions, got {len(h.shape)}", ErrorCode.SHAPE_MISMATCH)
    if any(d >= 2**32 for d in h.shape) or len(h.ids) >= 2**32:
        raise _err("dimension or id count does not fit 32 bits", ErrorCode.OVERSIZED)
    head = _HEAD.pack(
        FRAME_MAGIC, VERSION, h.codec, h.bits, DTYPE_IDS[h.dtype], flags, layout, aux, len(h.shape), 0,
        h.group_size, len(h.ids),
    )  # fmt: skip
    shape = struct.pack(f"<{len(h.shape)}I", *h.shape)
    try:
        ids = struct.pack(f"<{len(h.ids)}Q", *h.ids)
    except struct.error:
        raise _err("example ids must be integers in [0, 2**64)", ErrorCode.MALFORMED) from None
    return head + shape + ids


def build_frame(h: FrameHeader, scales: torch.Tensor | None, payload: torch.Tensor) -> bytes:
    """Header + scales (converted to the scale type) + payload bytes."""
    parts: list[bytes | memoryview] = [encode_header(h)]
    if scales is not None:
        assert h.aux_dtype is not None and scales.numel() == h.n_scales
        parts.append(_tensor_bytes(scales.to(h.aux_dtype)))
    assert payload.numel() * payload.element_size() == h.payload_nbytes
    parts.append(_tensor_bytes(payload))
    return b"".join(parts)


def _tensor_bytes(t: torch.Tensor) -> memoryview | bytes:
    t = to_host(t.detach().contiguous())  # a device tensor: one (pinned, on CUDA) copy
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().data.cast("B")  # zero-copy; join() copies once


def parse_header(buf: memoryview) -> FrameHeader:
    if len(buf) < _HEAD.size:
        raise _err(
            f"frame of {len(buf)} bytes is shorter than its {_HEAD.size}-byte header", ErrorCode.TRUNCATED
        )
    magic, version, codec, bits, dtype, flags, layout, aux, ndim, reserved, group, n_ids = _HEAD.unpack_from(
        buf
    )
    if magic != FRAME_MAGIC:
        raise _err(f"not a compressed-tensor frame (magic {bytes(magic)!r})", ErrorCode.MALFORMED)
    if version != VERSION:
        raise _err(f"frame version {version} (this peer speaks {VERSION})", ErrorCode.UNSUPPORTED_VERSION)
    if codec not in CODEC_NAMES:
        raise _err(f"unknown codec id {codec}", ErrorCode.UNKNOWN_CODEC)
    if dtype not in DTYPES:
        raise _err(f"unknown dtype id {dtype}", ErrorCode.DTYPE_MISMATCH)
    if flags & ~_KNOWN_FLAGS or reserved:
        raise _err(f"unknown flags {flags:#x} or reserved field {reserved}", ErrorCode.MALFORMED)
    if ndim > MAX_NDIM:
        raise _err(f"{ndim} dimensions (at most {MAX_NDIM})", ErrorCode.MALFORMED)
    if codec == CODEC_RAW:
        if layout != LAYOUT_NONE or aux not in DTYPES or group:
            raise _err("raw frame with a scale layout or unknown payload type", ErrorCode.MALFORMED)
        if bits != 8 * DTYPES[aux].itemsize:
            raise _err(f"raw {DTYPES[aux]} payload announced as {bits}-bit", ErrorCode.UNSUPPORTED_BITS)
        if flags & FLAG_SYMMETRIC:
            raise _err("raw frame with the symmetric flag", ErrorCode.MALFORMED)
    else:
        if bits not in SUPPORTED_BITS:
            raise _err(f"{bits}-bit codes are not supported", ErrorCode.UNSUPPORTED_BITS)
        if layout not in LAYOUT_NAMES or aux not in (DTYPE_IDS[torch.float32], DTYPE_IDS[torch.bfloat16]):
            raise _err(f"bad scale layout {layout} or scale type {aux}", ErrorCode.MALFORMED)
        if (layout == LAYOUT_GROUP) != (group > 0):
            raise _err("group size must be set exactly for the group layout", ErrorCode.MALFORMED)
    end = _HEAD.size + 4 * ndim + 8 * n_ids
    if len(buf) < end:
        raise _err("frame ends inside its shape or id list", ErrorCode.TRUNCATED)
    shape = struct.unpack_from(f"<{ndim}I", buf, _HEAD.size)
    ids = struct.unpack_from(f"<{n_ids}Q", buf, _HEAD.size + 4 * ndim)
    seed = bool(flags & FLAG_SEED)
    if codec == CODEC_DELTA and seed:
        raise _err("a delta frame cannot seed buffers", ErrorCode.MALFORMED)
    if (codec == CODEC_DELTA or seed or n_ids) and (not shape or shape[0] != n_ids):
        raise _err(f"{n_ids} example ids for shape {shape}: one id per row needed", ErrorCode.SHAPE_MISMATCH)
    if len(set(ids)) != len(ids):
        raise _err("duplicate example ids", ErrorCode.MALFORMED)
    return FrameHeader(
        codec=codec, bits=bits, dtype=DTYPES[dtype], aux_dtype=DTYPES[aux] if aux else None,
        shape=tuple(shape), ids=tuple(ids), symmetric=bool(flags & FLAG_SYMMETRIC), seed=seed,
        layout=LAYOUT_NAMES.get(layout), group_size=group,
    )  # fmt: skip


def parse_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Validate a frame's lengths and return zero-copy views of its scales and payload."""
    buf = memoryview(data).cast("B")
    h = parse_header(buf)
    need = h.nbytes  # sizes from the header, computed without allocating anything
    if len(buf) < need:
        raise _err(f"frame of {len(buf)} bytes, header announces {need}", ErrorCode.TRUNCATED)
    if len(buf) > need:
        raise _err(f"{len(buf) - need} trailing bytes after the frame", ErrorCode.MALFORMED)
    off = h.head_nbytes
    scales = None
    if h.codec != CODEC_RAW:
        assert h.aux_dtype is not None
        raw = _view(buf, off, h.scales_nbytes).view(h.aux_dtype)
        scales = raw.float()
        off += h.scales_nbytes
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise _err("scales must be finite and non-negative", ErrorCode.NON_FINITE)
        top = 2**h.bits - 1 if h.symmetric else 2 ** (h.bits - 1)  # largest |level|
        if scales.numel() and float(scales.max()) * top > torch.finfo(h.dtype).max:
            raise _err(f"scales decode beyond the {h.dtype} range", ErrorCode.NON_FINITE)
    return Frame(h, scales, _view(buf, off, h.payload_nbytes))


def _view(buf: memoryview, offset: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffer: we never write through these views
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


def build_packet(p: Packet) -> bytes:
    if not 1 <= len(p.frames) <= MAX_FRAMES:
        raise _err(f"a packet holds 1-{MAX_FRAMES} frames, got {len(p.frames)}", ErrorCode.MALFORMED)
    parts: list[bytes] = [_PACKET_HEAD.pack(PACKET_MAGIC, VERSION, len(p.frames), len(p.ids))]
    parts.append(struct.pack(f"<{len(p.ids)}Q", *p.ids))
    for f in p.frames:
        parts.append(struct.pack("<I", len(f)))
        parts.append(f)
    return b"".join(parts)


def parse_packet(data: bytes | bytearray | memoryview) -> tuple[tuple[int, ...], list[Frame]]:
    """Split a packet into its id order and parsed frames; the frames' ids must cover it exactly."""
    buf = memoryview(data).cast("B")
    if len(buf) < _PACKET_HEAD.size:
        raise _err("packet shorter than its header", ErrorCode.TRUNCATED)
    magic, version, n_frames, n_rows = _PACKET_HEAD.unpack_from(buf)
    if magic != PACKET_MAGIC:
        raise _err(f"not an activation packet (magic {bytes(magic)!r})", ErrorCode.MALFORMED)
    if version != VERSION:
        raise _err(f"packet version {version} (this peer speaks {VERSION})", ErrorCode.UNSUPPORTED_VERSION)
    if not 1 <= n_frames <= MAX_FRAMES:
        raise _err(f"a packet holds 1-{MAX_FRAMES} frames, got {n_frames}", ErrorCode.MALFORMED)
    off = _PACKET_HEAD.size + 8 * n_rows
    if len(buf) < off:
        raise _err("packet ends inside its id list", ErrorCode.TRUNCATED)
    ids = struct.unpack_from(f"<{n_rows}Q", buf, _PACKET_HEAD.size)
    frames = []
    for _ in range(n_frames):
        if len(buf) < off + 4:
            raise _err("packet ends before a frame length", ErrorCode.TRUNCATED)
        (length,) = struct.unpack_from("<I", buf, off)
        if len(buf) < off + 4 + length:
            raise _err("packet ends inside a frame", ErrorCode.TRUNCATED)
        frames.append(parse_frame(buf[off + 4 : off + 4 + length]))
        off += 4 + length
    if off != len(buf):
        raise _err(f"{len(buf) - off} trailing bytes after the packet", ErrorCode.MALFORMED)
    covered = [i for f in frames for i in f.header.ids]
    if len(set(ids)) != len(ids) or sorted(covered) != sorted(ids):
        raise _err("frame ids do not cover the packet's ids exactly once", ErrorCode.MALFORMED)
    return ids, frames
