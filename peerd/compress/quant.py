"""Uniform b-bit quantization kernel: scale selection, fused quantize-to-codes, exact dequantize/update.

Numbers (protocols/compressed-tensor.md, "Values"): a code ``q`` in ``[0, L)``, ``L = 2**bits``,
stands for the value ``k(q) * s`` with ``k = 2q - (L - 1)`` on the symmetric grid (odd levels,
no zero) or ``k = q - L/2`` on the zero grid, and ``s`` the stored scale of the element's
channel or group. Scales are rounded *up* to bfloat16 (8 significant bits) or to 16
significant bits in float32, so ``k * s`` (|k| <= 255) is exact in float32: every device
computes bit-identical reconstructions, with or without fused multiply-add. That is what keeps
the AC-SGD sender and receiver buffers identical.

The clip range per channel/group is ``absmax`` (no clipping) or ``rms``: ``alpha_b * rms``
(the MSE-optimal clip of a uniform quantizer for Gaussian data) kept within
``[absmax/2, absmax]``. Scales are relative to each channel's own magnitude, so tensors down
to ~1e-33 keep their relative precision (no absolute epsilon).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from peerd.compress.packing import PackLayout, check_bits, code_buffer, pack_layout
from peerd.errors import CodecError, ConfigError, ErrorCode

# Clip / rms of the MSE-optimal uniform quantizer for a unit Gaussian with 2**b cells
# (optimal steps 0.9957, 0.5860, 0.3352 from Max (1960); clip = 2**(b-1) * step). At 8 bits the
# optimum (3.94) is above a 1024-row absmax (~3.4): measured, absmax is as good, so 8-bit never clips.
RMS_CLIP = {2: 1.991, 3: 2.344, 4: 2.682}
# Channels whose clip range is below this are sent as exact zeros: keeps s and 1/s normal floats.
TINY = 2.0**-116


@dataclass
class QuantConfig:
    """How a tensor is quantized (a job spec's compression settings fill this)."""

    bits: int = 4
    """Code width: 2, 3, 4 or 8."""
    layout: Literal["channel", "group"] = "channel"
    """``channel``: one scale per last-dim channel over all rows; ``group``: one scale per run of
    ``group_size`` consecutive elements of the flattened tensor."""
    group_size: int = 128
    """Elements per scale in the ``group`` layout."""
    symmetric: bool = True
    """Symmetric grid (levels +-s, +-3s, ...; no zero) instead of the zero grid (k = q - L/2)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """``stochastic``: unbiased randomized rounding (the convergence theory's assumption)."""
    scale: Literal["rms", "absmax"] = "rms"
    """Clip range per channel/group: ``absmax`` never clips; ``rms`` clips at the Gaussian
    MSE-optimal multiple of the rms (lower error, clipped outliers)."""
    scale_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Wire type of the scales (bfloat16: 2 bytes, range of float32; float32: 16 significant bits)."""

    def validate(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise ConfigError("bits", f"must be one of 2, 3, 4, 8, got {self.bits}")
        if self.layout == "group" and self.group_size < 1:
            raise ConfigError("group_size", f"must be >= 1, got {self.group_size}")


@dataclass
class Quantized:
    """Codes and scales of one tensor, before serialization."""

    codes: torch.Tensor  # uint8 (layout.padded_len,), each < 2**bits, padding zero
    scales: torch.Tensor  # float32 (n_scales,), exactly representable in the scale dtype
    pack: PackLayout
    shape: tuple[int, ...]


def matrix_shape(shape: tuple[int, ...], layout: str, group_size: int) -> tuple[int, int]:
    """(rows, cols) of the 2-D view the scales apply to; channel: scales over cols, group: over rows."""
    n = 1
    for d in shape:
        n *= d
    if layout == "channel":
        cols = shape[-1] if shape else 1
        return (n // cols if cols else 0), cols
    return -(-n // group_size), group_size


def n_scales(shape: tuple[int, ...], layout: str, group_size: int) -> int:
    rows, cols = matrix_shape(shape, layout, group_size)
    return cols if layout == "channel" else rows


def scale_view(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Scales shaped to broadcast against the (rows, cols) matrix."""
    return scales.view(1, -1) if layout == "channel" else scales.view(-1, 1)


def _round_up_scale(s: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round positive float32 scales up to 8 (bfloat16) or 16 (float32) significant bits."""
    drop = 0xFFFF if scale_dtype == "bfloat16" else 0xFF
    bits = s.contiguous().view(torch.int32)
    return torch.bitwise_and(bits + drop, ~drop).view(torch.float32)


def reach(bits: int, symmetric: bool, stochastic: bool) -> float:
    """How many steps the grid reaches above zero without clipping, in units of the step."""
    half = 2 ** (bits - 1)
    if symmetric:
        return half - 0.5 if stochastic else float(half)
    return half - 1.0 if stochastic else half - 0.5


class Workspace:
    """Reusable float32/uint8 scratch buffers (page faults on fresh 16 MB buffers cost ~ms)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:n]


def choose_scales(
    mat: torch.Tensor, cfg: QuantConfig, work: Workspace | None = None, last_count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scales ``s`` and quantization multipliers ``1/step`` for ``mat`` (rows, cols) float32.

    ``last_count``: real elements in the last (zero-padded) group of the group layout.
    """
    dim = 0 if cfg.layout == "channel" else 1
    if mat.numel() == 0:
        zeros = torch.zeros(mat.shape[1 - dim], dtype=torch.float32, device=mat.device)
        return zeros, zeros.clone()
    amax = torch.maximum(mat.amax(dim), mat.amin(dim).neg_())  # NaN/Inf propagate: the finiteness check
    if not bool(torch.isfinite(amax).all()):
        raise CodecError("tensor holds NaN or Inf", code=ErrorCode.NON_FINITE)
    clip = amax
    if cfg.scale == "rms" and cfg.bits < 8 and mat.shape[dim] > 1:
        if dim == 1:
            sumsq = torch.linalg.vector_norm(mat, dim=1).square_()
        else:  # vector_norm over dim 0 is ~10x slower than square-then-sum on CPU
            sq = (work or Workspace()).get("sq", mat.numel(), torch.float32, mat.device).view(mat.shape)
            sumsq = torch.mul(mat, mat, out=sq).sum(0)
        # Squares overflow above ~1e19 and underflow below ~1e-19: rescale by absmax (rare, one more pass).
        if not bool(torch.isfinite(sumsq).all()) or bool(((amax < 2.0**-60) & (amax > 0)).any()):
            safe = torch.where(amax > 0, amax, torch.ones_like(amax))
            unit = (mat / scale_view(safe, cfg.layout)).square_().sum(dim)
            sumsq, unit_scale = unit, safe
        else:
            unit_scale = None
        counts = torch.full_like(sumsq, float(mat.shape[dim]))
        if last_count is not None:
            counts[-1] = float(last_count)
        rms = sumsq.div_(counts).sqrt_()
        if unit_scale is not None:
            rms.mul_(unit_scale)
        clip = torch.minimum(torch.maximum(rms.mul_(RMS_CLIP[cfg.bits]), amax * 0.5), amax)
    step = clip / reach(cfg.bits, cfg.symmetric, cfg.rounding == "stochastic")
    stored = step * 0.5 if cfg.symmetric else step
    stored = _round_up_scale(stored, cfg.scale_dtype)
    if not bool(torch.isfinite(stored).all()):
        raise CodecError("tensor magnitude too large for the scale type", code=ErrorCode.NON_FINITE)
    stored = torch.where(clip < TINY, torch.zeros_like(stored), stored)
    step = stored * 2.0 if cfg.symmetric else stored
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    return stored, inv


def quantize(
    x: torch.Tensor,
    cfg: QuantConfig,
    *,
    work: Workspace | None = None,
    generator: torch.Generator | None = None,
    inplace: bool = False,
) -> Quantized:
    """Quantize ``x`` (any shape; the scale layout decides the 2-D view) to codes and scales.

    ``x`` is only read, unless ``inplace``: then it must be a contiguous float32 tensor the
    caller no longer needs (e.g. the AC-SGD delta computed into ``work.get("mat", ...)``), and
    it is overwritten, saving a pass. Raises CodecError(NON_FINITE) for NaN/Inf input. The
    result's codes may live in ``work``: valid until the next call with the same workspace.
    """
    check_bits(cfg.bits)
    x = x.detach()
    shape = tuple(x.shape)
    n = x.numel()
    work = work or Workspace()
    rows, cols = matrix_shape(shape, cfg.layout, cfg.group_size)
    lay = pack_layout(cfg.bits, n)
    dev = x.device
    ragged = rows * cols != n  # group layout whose last group is short: pad with zeros
    if inplace and not ragged:
        assert x.dtype == torch.float32 and x.is_contiguous()
        flat = x.view(-1)
        src = mat = flat.view(rows, cols)
    else:
        flat = work.get("mat2" if inplace else "mat", rows * cols, torch.float32, dev)
        mat = flat.view(rows, cols)
        if ragged:
            flat[:n].copy_(x.reshape(-1))
            flat[n:].zero_()
            src = mat
        else:
            src = x.reshape(rows, cols)
            if src.dtype != torch.float32:
                src = src.float()
    scales, inv = choose_scales(src, cfg, work, last_count=n - (rows - 1) * cols if ragged else None)
    L = 2**cfg.bits
    half = L // 2
    stochastic = cfg.rounding == "stochastic"
    if cfg.symmetric:
        offset = half - 0.5 if stochastic else float(half)
    else:
        offset = float(half) if stochastic else half + 0.5
    # y = x / step + offset; floor(y) clamped to [0, L-1] is the code (nearest level, or unbiased
    # randomized rounding when uniform noise in [0, 1) is added).
    torch.addcmul(torch.tensor(offset, device=dev), src, scale_view(inv, cfg.layout), out=mat)
    if stochastic:
        noise = work.get("noise", rows * cols, torch.float32, dev).view(rows, cols)
        mat.add_(torch.rand(rows, cols, generator=generator, device=dev, out=noise))
    mat.clamp_(0.0, L - 1.0)
    codes = code_buffer(lay, dev) if lay.padded_len != n else work.get("codes", n, torch.uint8, dev)
    codes[:n].copy_(flat[:n])  # float -> uint8 truncates toward zero == floor for values >= 0
    return Quantized(codes=codes, scales=scales, pack=lay, shape=shape)


def levels(codes: torch.Tensor, bits: int, symmetric: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Signed integer levels k(q) (int8, or int16 for the 8-bit symmetric grid) of uint8 codes."""
    L = 2**bits
    if symmetric and bits == 8:
        k = codes.to(torch.int16)
        return k.mul_(2).sub_(L - 1)
    if out is None:
        out = torch.empty_like(codes)
    if symmetric:
        torch.mul(codes, 2, out=out).sub_(L - 1)  # uint8 arithmetic wraps: two's complement int8
    else:
        torch.sub(codes, L // 2, out=out)
    return out.view(torch.int8)


def dequantize_into(
    out: torch.Tensor, k: torch.Tensor, scales: torch.Tensor, cfg: QuantConfig, *, add: float | None = None
) -> torch.Tensor:
    """``out = k * s``, or ``out += add * k * s`` when ``add`` is given (+1 or -1: still exact).

    ``out`` is float32; ``k`` (levels, any numeric dtype) may hold padding beyond
    ``out.numel()`` (ignored). Every product is exact, so results are bit-identical on every device.
    """
    n = out.numel()
    rows, cols = matrix_shape(tuple(out.shape), cfg.layout, cfg.group_size)
    sv = scale_view(scales, cfg.layout)
    if rows * cols != n:  # ragged group layout: last group separately
        full = (n // cols) * cols
        head = out.view(-1)[:full].view(-1, cols)
        _mul_or_add(head, k[:full].view(-1, cols), sv[: full // cols], add)
        _mul_or_add(out.view(-1)[full:], k[full:n], sv[full // cols].view(1), add)
        return out
    _mul_or_add(out.view(rows, cols), k[:n].view(rows, cols), sv, add)
    return out


def _mul_or_add(out: torch.Tensor, k: torch.Tensor, s: torch.Tensor, add: float | None) -> None:
    if add is None:
        torch.mul(k, s, out=out)
    else:
        out.addcmul_(k, s, value=add)
