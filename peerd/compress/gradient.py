"""Compressed exchange of gradients (or optimizer moments) with per-key error feedback, optionally staged.

The data-parallel averaging layer encodes each value under a key (e.g. ``"send/2"``: the share
sent to rank 2) before sending, and receivers decode the frame. With error feedback the
compressor remembers, per key, what quantization dropped, ``e <- (x + e) - D(Q(x + e))``, and
adds it to the next value under that key, so the error does not accumulate over steps: summed
over ``T`` steps, what was reconstructed equals the sum of the inputs minus the last residual.

A group step may fail after some frames were sent; its retry must send the very same bytes.
So new residuals can be *staged* (``stage=True``): they take effect on ``commit()`` (the step
succeeded everywhere) and are dropped by ``discard()``; until then encodes keep using the
committed residuals. Unstaged encodes update the residual at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from peerd.compress import wire
from peerd.compress.codecs import RawCodec, TensorCodec, UniformCodec, decode_frame
from peerd.compress.quant import QuantConfig, dequantize_into
from peerd.errors import CodecError, ErrorCode
from peerd.log import get_logger

log = get_logger(__name__)


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


@dataclass
class Encoded:
    """One encoded value: the frame bytes and exactly what every receiver reconstructs from them."""

    payload: bytes
    decoded: torch.Tensor  # float32, the input's shape


class ErrorFeedbackCompressor:
    """Encodes tensors by key and keeps each key's residual (float32, on the tensor's device).

    The codec is a uniform quantizer from ``cfg`` unless ``codec`` names another (any
    ``TensorCodec``); a lossless one (raw float32) keeps no residuals and decodes to the input
    itself. ``on_reshape``: what a key whose tensor changed shape does with its old residual,
    ``"raise"`` (CodecError SHAPE_MISMATCH; ``reset`` the key first) or ``"reset"`` (dropped
    with a warning, e.g. the averaging group's shares after a re-plan).
    Not thread-safe (codecs reuse scratch buffers); use one per sending thread.
    """

    def __init__(
        self,
        cfg: GradCompressionConfig | None = None,
        generator: torch.Generator | None = None,
        *,
        codec: TensorCodec | None = None,
        on_reshape: Literal["raise", "reset"] = "raise",
    ) -> None:
        self.cfg = cfg or GradCompressionConfig()
        self.cfg.validate()
        self.codec = codec if codec is not None else UniformCodec(self.cfg.quant, generator=generator)
        self.lossless = isinstance(self.codec, RawCodec) and self.codec.payload_dtype == torch.float32
        self.on_reshape = on_reshape
        self._residuals: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}

    def encode(self, key: str, x: torch.Tensor, *, stage: bool = False) -> Encoded:
        """Frame for ``x + residual[key]``; the new residual is what the frame fails to carry.

        ``x`` is not modified. With ``stage`` the new residual waits for ``commit``.
        """
        x = x.detach()
        if self.lossless or not self.cfg.error_feedback:
            payload, decoded = self.codec.encode(x, reconstruct=True)  # fp32: the input itself
            assert decoded is not None
            return Encoded(payload, decoded)
        e = self._residuals.get(key)
        if e is not None and e.shape != x.shape:
            if self.on_reshape == "raise":
                raise CodecError(
                    f"tensor {key!r} changed shape {tuple(e.shape)} -> {tuple(x.shape)}; reset() it first",
                    code=ErrorCode.SHAPE_MISMATCH,
                )
            log.warning(
                "error feedback %r: shape %s -> %s, residual dropped", key, tuple(e.shape), tuple(x.shape)
            )
            e = None
        # v = x + e in a fresh tensor: if the codec refuses v (NaN/Inf), the old residual stays intact
        v = x.to(torch.float32, copy=True) if e is None else torch.add(e, x)
        payload, decoded = self._encode(v, x.dtype)
        # e' = v - D(Q(v)): D's products are exact, so this is one rounding, as on every receiver
        (self._staged if stage else self._residuals)[key] = v.sub_(decoded)
        return Encoded(payload, decoded)

    def _encode(self, v: torch.Tensor, dtype: torch.dtype) -> tuple[bytes, torch.Tensor]:
        codec = self.codec
        if isinstance(codec, UniformCodec):  # the frame announces the caller's dtype, not float32
            q = codec.quantize(v)
            payload = codec.frame(q, dtype)
            decoded = torch.empty(q.shape, dtype=torch.float32, device=v.device)
            return payload, dequantize_into(decoded, codec.levels(q), q.scales, codec.cfg)
        payload, recon = codec.encode(v, reconstruct=True)
        assert recon is not None
        return payload, recon

    def compress(self, key: str, x: torch.Tensor, *, stage: bool = False) -> bytes:
        """``encode(key, x, stage=stage).payload``."""
        return self.encode(key, x, stage=stage).payload

    def commit(self) -> None:
        """The step succeeded everywhere it matters: staged residuals become current."""
        self._residuals.update(self._staged)
        self._staged.clear()

    def discard(self) -> None:
        """The step failed: forget staged residuals (a retry re-encodes the same values to the same bytes)."""
        self._staged.clear()

    @staticmethod
    def decompress(data: bytes | memoryview, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor a frame from any peer's ``compress`` carries."""
        frame = wire.parse_frame(data)
        if frame.header.codec == wire.CODEC_DELTA:
            raise CodecError("a delta frame needs the AC-SGD decoder", code=ErrorCode.UNKNOWN_CODEC)
        return decode_frame(frame, device=device)

    def residual(self, key: str) -> torch.Tensor | None:
        """The committed residual of ``key``."""
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Drop one key's residual (or all), staged ones included, e.g. after the parameter set changed."""
        if key is None:
            self._residuals.clear()
            self._staged.clear()
        else:
            self._residuals.pop(key, None)
            self._staged.pop(key, None)

    @property
    def residual_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self._residuals.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Committed residuals for a checkpoint (copies)."""
        return {k: e.detach().clone() for k, e in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: e.detach().to(torch.float32).clone() for k, e in state.items()}
        self._staged.clear()
