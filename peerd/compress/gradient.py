"""Compressed exchange of gradients (or optimizer moments) with per-key error feedback.

The data-parallel averaging layer calls ``compress(key, tensor) -> bytes`` before sending and
``decompress(bytes) -> tensor`` on receipt. With error feedback the compressor remembers, per
key (e.g. a parameter name), what quantization dropped, ``e <- (x + e) - D(Q(x + e))``, and
adds it to the next tensor under that key, so the error does not accumulate over steps. The
reducer side keeps its own compressor (own residuals) for the averaged result it sends back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peerd.compress import wire
from peerd.compress.codecs import UniformCodec, decode_frame
from peerd.compress.quant import QuantConfig, dequantize_into
from peerd.errors import CodecError, ErrorCode


def _default_quant() -> QuantConfig:
    # Groups, not channels: gradients include 1-D tensors (biases, norms) where a per-channel
    # scale would cost 16 bits per element. absmax: no clipping bias on rare large entries.
    return QuantConfig(bits=8, layout="group", group_size=256, scale="absmax")


@dataclass
class GradCompressionConfig:
    """How gradients are compressed for the data-parallel exchange."""

    quant: QuantConfig = field(default_factory=_default_quant)
    error_feedback: bool = True
    """Carry each key's quantization error into its next compression."""

    def validate(self) -> None:
        self.quant.validate()


class ErrorFeedbackCompressor:
    """Quantizes tensors by key and keeps each key's residual (float32, on the tensor's device).

    Not thread-safe (shared scratch buffers); use one per sending thread.
    """

    def __init__(
        self, cfg: GradCompressionConfig | None = None, generator: torch.Generator | None = None
    ) -> None:
        self.cfg = cfg or GradCompressionConfig()
        self.cfg.validate()
        self.codec = UniformCodec(self.cfg.quant, generator=generator)
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, key: str, x: torch.Tensor) -> bytes:
        """Frame for ``x + residual[key]``; the residual becomes what this frame fails to carry."""
        if not self.cfg.error_feedback:
            data, _ = self.codec.encode(x)
            return data
        e = self._residuals.get(key)
        if e is not None and e.shape != x.shape:
            raise CodecError(
                f"tensor {key!r} changed shape {tuple(e.shape)} -> {tuple(x.shape)}; reset() it first",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        # v = x + e in a fresh tensor: if quantization refuses v (NaN/Inf), the old residual stays intact.
        v = x.detach().to(torch.float32, copy=True) if e is None else torch.add(e, x.detach())
        q = self.codec.quantize(v)
        data = self.codec.frame(q, x.dtype)
        dequantize_into(v, self.codec.levels(q), q.scales, self.cfg.quant, add=-1.0)  # v - D(Q(v))
        self._residuals[key] = v
        return data

    @staticmethod
    def decompress(data: bytes | memoryview, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor a frame from any peer's ``compress`` carries."""
        frame = wire.parse_frame(data)
        if frame.header.codec == wire.CODEC_DELTA:
            raise CodecError("a delta frame needs the AC-SGD decoder", code=ErrorCode.UNKNOWN_CODEC)
        return decode_frame(frame, device=device)

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Drop one key's residual (or all), e.g. after the parameter set changed."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    @property
    def residual_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self._residuals.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals for a checkpoint (copies)."""
        return {k: e.detach().clone() for k, e in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: e.detach().to(torch.float32).clone() for k, e in state.items()}
