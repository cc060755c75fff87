"""The policy weights a trainer sends its rollout peers: a flat fp32 blob, checked whole before it is used.

Layout (``protocols/rl.md``, "Weights blob"), integers little-endian:

    offset  size  field
    0       2     magic ``PW``
    2       1     format, 1
    3       1     reserved, 0
    4       4     index length L (u32)
    8       L     index: canonical msgpack ``{"tensors": [[name, shape], ...], "version": int}``
    8 + L   pad   zero bytes up to a multiple of 8
    ...           every tensor's float32 values (little-endian, row-major), in index order

and nothing after. Reading it is one index decode, one finiteness check over all values and
one copy per tensor, where ``torch.load`` of the same state dict spent ~1.4 ms in its
unpickler for a 29-tensor policy whatever its size; and a blob from another peer is parsed by
these checks alone, never by an unpickler. ``read_weights`` checks everything (layout, the
version asked for, names and shapes against the receiver's own model, finite values) before it
writes into that model, so a refused blob leaves the weights held as they were.
"""

from __future__ import annotations

import struct
import sys
from typing import Annotated

import torch
from msgspec import Meta

from peerd.errors import ErrorCode, ProtocolError
from peerd.wire import canonical_pack, decode_value
from peerd.wire.types import Count, Name, WireStruct

if sys.byteorder != "little":  # torch.frombuffer reads native order; the format is little-endian
    raise ImportError("peerd's rl weights blobs need a little-endian host")

MAGIC = b"PW"
FORMAT = 1
_PREFIX = struct.Struct("<2sBBI")  # magic, format, reserved, index length
MAX_INDEX_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_DIMS = 8

Shape = Annotated[list[Annotated[int, Meta(ge=0, le=2**31)]], Meta(max_length=MAX_DIMS)]


class WeightsIndex(WireStruct, kw_only=True):
    """What the blob holds: the policy version and each tensor's name and shape, in data order."""

    version: Count
    tensors: Annotated[list[tuple[Name, Shape]], Meta(max_length=MAX_TENSORS)]


def _data_offset(index_len: int) -> int:
    return -(-(_PREFIX.size + index_len) // 8) * 8


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of ``model``'s state dict: what a trainer packs for its rollout peers and
    checkpoints hold."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def pack_weights(version: int, weights: dict[str, torch.Tensor]) -> bytes:
    """``weights`` (a state dict of float32 tensors) as the blob of policy ``version``."""
    for name, t in weights.items():
        if t.dtype != torch.float32:
            raise ValueError(f"weights blob: {name} is {t.dtype}; the rl runtime sends float32 only")
    index = canonical_pack(
        WeightsIndex(version=version, tensors=[(n, list(t.shape)) for n, t in weights.items()])
    )
    start = _data_offset(len(index))
    values = sum(t.numel() for t in weights.values())
    out = bytearray(start + 4 * values)
    _PREFIX.pack_into(out, 0, MAGIC, FORMAT, 0, len(index))
    out[_PREFIX.size : _PREFIX.size + len(index)] = index
    if values:  # every tensor's values straight into the blob, in index order
        flat = torch.frombuffer(out, dtype=torch.float32, offset=start)
        torch.cat([t.detach().reshape(-1).cpu() for t in weights.values()], out=flat)
    return bytes(out)


def read_weights(blob: bytes | bytearray | memoryview, into: dict[str, torch.Tensor], version: int) -> None:
    """Check ``blob`` against the version asked for and the receiver's own tensors ``into`` (its
    model's state dict), then copy its values into them; ``ProtocolError`` (nothing written) if
    it is not the blob of ``version`` for exactly those names and shapes with finite values."""
    view = memoryview(blob).cast("B")
    if len(view) < _PREFIX.size:
        raise ProtocolError(f"weights blob of {len(view)} bytes is shorter than its prefix")
    magic, fmt, reserved, index_len = _PREFIX.unpack_from(view)
    if magic != MAGIC or reserved != 0:
        raise ProtocolError(f"weights blob: bad magic {bytes(magic)!r} or reserved byte {reserved}")
    if fmt != FORMAT:
        raise ProtocolError(
            f"weights blob format {fmt} (this peer reads {FORMAT})", code=ErrorCode.UNSUPPORTED_VERSION
        )
    if index_len > min(MAX_INDEX_BYTES, len(view) - _PREFIX.size):
        raise ProtocolError(
            f"weights blob: index of {index_len} bytes in a {len(view)}-byte blob", code=ErrorCode.OVERSIZED
        )
    index: WeightsIndex = decode_value(
        view[_PREFIX.size : _PREFIX.size + index_len],
        WeightsIndex,
        max_bytes=MAX_INDEX_BYTES,
        what="weights index",
    )
    if index.version != version:
        raise ProtocolError(
            f"weights blob of version {index.version}, asked for {version}", code=ErrorCode.WRONG_STEP
        )
    expected = [(name, list(t.shape)) for name, t in into.items()]
    got = [(name, list(shape)) for name, shape in index.tensors]
    if got != expected:
        wrong = next(((g, e) for g, e in zip(got, expected, strict=False) if g != e), None)
        detail = (
            f"{wrong[0]} where the model has {wrong[1]}"
            if wrong
            else f"{len(got)} tensors, not {len(expected)}"
        )
        raise ProtocolError(
            f"weights blob does not fit the job's model: {detail}", code=ErrorCode.SHAPE_MISMATCH
        )
    start = _data_offset(index_len)
    values = sum(t.numel() for t in into.values())
    if len(view) != start + 4 * values or any(view[_PREFIX.size + index_len : start]):
        raise ProtocolError(
            f"weights blob of {len(view)} bytes; its index needs {start + 4 * values} with zero padding"
        )
    if not values:
        return
    data = view[start:]
    if data.readonly:  # torch.frombuffer shares writable buffers only; the copy is one memcpy
        data = memoryview(bytearray(data))
    flat = torch.frombuffer(data, dtype=torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ProtocolError(f"weights of version {version} hold NaN or Inf", code=ErrorCode.NON_FINITE)
    at = 0
    with torch.no_grad():
        for t in into.values():
            n = t.numel()
            t.copy_(flat[at : at + n].view(t.shape))
            at += n


__all__ = ["FORMAT", "MAGIC", "WeightsIndex", "pack_weights", "policy_weights", "read_weights"]
