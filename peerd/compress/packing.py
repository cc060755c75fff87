"""Planar bit packing of 2/3/4/8-bit codes into bytes with word-wide shifts (no 8x bit-array expansion).

Layout (protocols/compressed-tensor.md, "Packed codes"): ``n`` codes of ``b`` bits are cut
into ``g`` equal *planes* of ``P = ceil(n / g)`` codes (code ``i`` is plane ``i // P``,
position ``i % P``; missing codes at the end count as 0). Position ``t`` of every plane
forms one group whose value is ``sum_j code[j][t] << (b * j)``; a group is 1 byte (b = 2, 4, 8)
or 3 bytes (b = 3, eight codes). Byte ``r`` of every group is stored in byte-plane ``r``:
the payload is ``bytes_per_group`` byte-planes of ``P`` bytes each.

Why planes instead of neighbouring codes: plane ``j`` is a contiguous slice, so packing is a
handful of shift/or/and ops on int64 views of whole planes (8 codes per machine word, no
strided access). Shifts never carry between bytes because every code is < 2**b and every
right shift is masked afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peerd.errors import CodecError, ErrorCode

SUPPORTED_BITS = (2, 3, 4, 8)


def _rep(byte: int) -> int:
    """``byte`` repeated in all 8 bytes of an int64 (fits: every mask used here is < 0x80)."""
    return int.from_bytes(bytes([byte]) * 8, "little")


@dataclass(frozen=True)
class PackLayout:
    """Sizes of the packed form of ``n`` codes at ``bits`` bits."""

    bits: int
    n: int
    planes: int  # code planes g
    plane_len: int  # P = ceil(n / g)
    bytes_per_group: int

    @property
    def nbytes(self) -> int:
        return self.plane_len * self.bytes_per_group

    @property
    def padded_len(self) -> int:
        """Codes in the planar matrix including the zero padding at the end (g * P)."""
        return self.planes * self.plane_len


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise CodecError(
            f"{bits}-bit codes are not supported (supported: {', '.join(map(str, SUPPORTED_BITS))})",
            code=ErrorCode.UNSUPPORTED_BITS,
        )


def pack_layout(bits: int, n: int) -> PackLayout:
    check_bits(bits)
    planes = 8 if bits == 3 else 8 // bits
    plane_len = -(-n // planes)
    return PackLayout(bits, n, planes, plane_len, 3 if bits == 3 else 1)


def code_buffer(layout: PackLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """A uint8 buffer of ``padded_len`` codes with the padding tail zeroed; write codes into ``[:n]``."""
    buf = torch.empty(layout.padded_len, dtype=torch.uint8, device=device)
    if layout.padded_len > layout.n:
        buf[layout.n :].zero_()
    return buf


def _words(t: torch.Tensor) -> torch.Tensor:
    """int64 view of a contiguous uint8 tensor of a multiple of 8 bytes (copied if misaligned)."""
    if t.storage_offset() % 8:
        t = t.clone()
    return t.view(torch.int64)


def _aligned(mat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``mat`` (rows, p) uint8, or a zero-padded copy with p rounded up to a multiple of 8."""
    rows, p = mat.shape
    p8 = -(-p // 8) * 8
    if p8 != p:  # odd sizes only: planes must be whole words
        padded = torch.zeros(rows, p8, dtype=torch.uint8, device=mat.device)
        padded[:, :p] = mat
        mat = padded
    return mat, p8


def pack(codes: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """Pack ``codes`` (uint8, ``padded_len`` values each < 2**bits, padding zero) into a uint8 payload."""
    assert codes.dtype == torch.uint8 and codes.numel() == layout.padded_len
    b = layout.bits
    if b == 8 or layout.n == 0:
        return codes[: layout.n]
    mat, p8 = _aligned(codes.view(layout.planes, layout.plane_len))
    q = [_words(mat[j]) for j in range(layout.planes)]
    if b == 4:
        out = torch.bitwise_left_shift(q[1], 4).bitwise_or_(q[0])
        outs = [out]
    elif b == 2:
        out = torch.bitwise_left_shift(q[3], 6)
        out.bitwise_or_(torch.bitwise_left_shift(q[2], 4))
        out.bitwise_or_(torch.bitwise_left_shift(q[1], 2)).bitwise_or_(q[0])
        outs = [out]
    else:  # 3 bits: 8 codes -> 24 bits -> 3 byte-planes
        m1, m2 = _rep(0x01), _rep(0x03)
        b0 = torch.bitwise_left_shift(q[1], 3).bitwise_or_(q[0])
        b0.bitwise_or_(torch.bitwise_and(q[2], m2).bitwise_left_shift_(6))
        b1 = torch.bitwise_right_shift(q[2], 2).bitwise_and_(m1)
        b1.bitwise_or_(torch.bitwise_left_shift(q[3], 1)).bitwise_or_(torch.bitwise_left_shift(q[4], 4))
        b1.bitwise_or_(torch.bitwise_and(q[5], m1).bitwise_left_shift_(7))
        b2 = torch.bitwise_right_shift(q[5], 1).bitwise_and_(m2)
        b2.bitwise_or_(torch.bitwise_left_shift(q[6], 2)).bitwise_or_(torch.bitwise_left_shift(q[7], 5))
        outs = [b0, b1, b2]
    planes = [o.view(torch.uint8) for o in outs]
    if len(planes) == 1:
        out8 = planes[0]
        return out8 if p8 == layout.plane_len else out8[: layout.plane_len]
    return torch.stack(planes)[:, : layout.plane_len].reshape(-1)


def unpack(payload: torch.Tensor, layout: PackLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``pack``: uint8 payload -> uint8 codes of length ``padded_len`` (written into ``out``)."""
    assert payload.dtype == torch.uint8 and payload.numel() == layout.nbytes
    b, p = layout.bits, layout.plane_len
    if out is None:
        out = torch.empty(layout.padded_len, dtype=torch.uint8, device=payload.device)
    if b == 8:
        out[: layout.n].copy_(payload)
        return out
    if layout.n == 0:
        return out
    src, p8 = _aligned(payload.view(layout.bytes_per_group, p))
    direct = p8 == p and out.storage_offset() % 8 == 0
    dst = (
        out.view(layout.planes, p)
        if direct
        else torch.empty(layout.planes, p8, dtype=torch.uint8, device=out.device)
    )
    w = [_words(src[r]) for r in range(layout.bytes_per_group)]
    d = [dst[j].view(torch.int64) for j in range(layout.planes)]
    if b == 4:
        m = _rep(0x0F)
        torch.bitwise_and(w[0], m, out=d[0])
        torch.bitwise_right_shift(w[0], 4, out=d[1]).bitwise_and_(m)
    elif b == 2:
        m = _rep(0x03)
        torch.bitwise_and(w[0], m, out=d[0])
        for j in (1, 2, 3):
            torch.bitwise_right_shift(w[0], 2 * j, out=d[j]).bitwise_and_(m)
    else:
        m1, m2, m7 = _rep(0x01), _rep(0x03), _rep(0x07)
        b0, b1, b2 = w
        torch.bitwise_and(b0, m7, out=d[0])
        torch.bitwise_right_shift(b0, 3, out=d[1]).bitwise_and_(m7)
        torch.bitwise_right_shift(b0, 6, out=d[2]).bitwise_and_(m2)
        d[2].bitwise_or_(torch.bitwise_and(b1, m1).bitwise_left_shift_(2))
        torch.bitwise_right_shift(b1, 1, out=d[3]).bitwise_and_(m7)
        torch.bitwise_right_shift(b1, 4, out=d[4]).bitwise_and_(m7)
        torch.bitwise_right_shift(b1, 7, out=d[5]).bitwise_and_(m1)
        d[5].bitwise_or_(torch.bitwise_and(b2, m2).bitwise_left_shift_(1))
        torch.bitwise_right_shift(b2, 2, out=d[6]).bitwise_and_(m7)
        torch.bitwise_right_shift(b2, 5, out=d[7]).bitwise_and_(m7)
    if not direct:
        out.view(layout.planes, p).copy_(dst[:, :p])
    return out
