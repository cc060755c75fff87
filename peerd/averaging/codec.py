"""How gradient shares travel: a peerd.compress frame (raw fp32 or uniform b-bit), chosen by name or config.

Shares are 1-D float32 vectors, so the uniform codecs use the ``group`` scale layout (one
bfloat16 scale per ``group_size`` consecutive elements: 16/256 = 0.06 extra bits per
element) and ``absmax`` scales by default: every element's error is then at most
``absmax(group) / 2**bits`` (symmetric grid, nearest rounding), a bound the tests check, and
what clipping would have cut is not needed because error feedback carries the loss forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from peerd.compress import wire
from peerd.compress.codecs import TensorCodec, all_finite, decode_frame, make_codec
from peerd.compress.quant import QuantConfig
from peerd.errors import CodecError, ConfigError, ErrorCode

LOSSLESS = "fp32"
# Spellings a job spec may use for "no compression".
_NONE_NAMES = frozenset({"none", "fp32", "off"})


@dataclass(frozen=True)
class GradientCompression:
    """Gradient compression on the averaging wire (the job spec's gradient codec fills this)."""

    bits: int = 8
    """Code width of the uniform quantizer: 2, 3, 4 or 8."""
    group_size: int = 256
    """Consecutive elements sharing one scale."""
    scale: Literal["absmax", "rms"] = "absmax"
    """``absmax``: never clips (bounded error); ``rms``: lower mean error, clips outliers."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """Error feedback makes nearest rounding's bias harmless; stochastic is the unbiased option."""

    def bytes_per_value(self) -> float:
        """Wire bytes per averaged element: its code and its share of the group's bfloat16 scale."""
        return self.bits / 8 + 2 / self.group_size

    def validate(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise ConfigError("compression.bits", f"must be one of 2, 3, 4, 8, got {self.bits}")
        if self.group_size < 1:
            raise ConfigError("compression.group_size", f"must be >= 1, got {self.group_size}")

    def quant_config(self) -> QuantConfig:
        return QuantConfig(
            bits=self.bits,
            layout="group",
            group_size=self.group_size,
            symmetric=True,
            rounding=self.rounding,
            scale=self.scale,
            scale_dtype="bfloat16",
        )


Compressor = GradientCompression | str | None


def parse_compressor(spec: Compressor) -> GradientCompression | None:
    """None for lossless; ``"q8"``/``"uniform8"``/``"8"``-style names or a config for b-bit quantization."""
    if spec is None or isinstance(spec, GradientCompression):
        if spec is not None:
            spec.validate()
        return spec
    if not isinstance(spec, str):
        raise ConfigError("compressor", f"expected a name or GradientCompression, got {type(spec).__name__}")
    name = spec.strip().lower()
    if name in _NONE_NAMES:
        return None
    digits = name.removeprefix("uniform").removeprefix("q").removeprefix("int")
    if not digits.isdigit():
        raise ConfigError("compressor", f"unknown gradient compressor {spec!r} (none, q2, q3, q4, q8)")
    cfg = GradientCompression(bits=int(digits))
    cfg.validate()
    return cfg


def build_codec(cfg: GradientCompression | None) -> TensorCodec:
    """The peerd.compress codec for shares: raw fp32 when ``cfg`` is None."""
    if cfg is None:
        return make_codec(LOSSLESS)
    return make_codec("uniform", cfg.quant_config())


def finite(x: torch.Tensor) -> bool:
    """All elements finite (one min/max pass; see ``peerd.compress.codecs.all_finite``)."""
    return all_finite(x)


def decode_share(payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """A received share as float32 (numel,); CodecError for anything but a plain 1-D float32 frame."""
    frame = wire.parse_frame(payload)
    h = frame.header
    if h.codec == wire.CODEC_DELTA or h.ids or h.seed:
        raise CodecError(
            "gradient shares travel as raw or uniform frames without example ids",
            code=ErrorCode.UNKNOWN_CODEC,
        )
    if h.dtype != torch.float32:
        raise CodecError(
            f"gradient share announced as {h.dtype}, expected float32", code=ErrorCode.DTYPE_MISMATCH
        )
    if h.shape != (numel,):
        raise CodecError(
            f"gradient share of shape {h.shape}, expected ({numel},)", code=ErrorCode.SHAPE_MISMATCH
        )
    if h.codec == wire.CODEC_RAW and h.aux_dtype == torch.float32:  # the lossless path: one copy, one check
        values_N = torch.empty(numel, dtype=torch.float32)
        values_N.view(torch.uint8).copy_(frame.payload)
        if not finite(values_N):
            raise CodecError("raw gradient share holds NaN or Inf", code=ErrorCode.NON_FINITE)
        return values_N
    return decode_frame(frame, float32=True)
