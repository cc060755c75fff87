"""Error feedback for compressed gradient exchange: per-key residuals that carry exactly what quantization lost.

For a value ``x`` sent under key ``k`` with residual ``e`` (zero at first) the sender encodes
``y = x + e``; every receiver reconstructs ``D(Q(y))``; the new residual is
``e' = y − D(Q(y))``, exactly this step's loss, added back next step (compression.md). Summed
over ``T`` steps, what was reconstructed equals the sum of the inputs minus the last
residual, so the time-averaged error is ``|e_T| / T`` and vanishes.

New residuals are *staged* and become current only on ``commit``: a step that fails
somewhere in the group can be retried and re-encodes the very same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peerd.averaging.codec import encode_raw, is_lossless
from peerd.compress.codecs import TensorCodec
from peerd.log import get_logger

logger = get_logger(__name__)


@dataclass
class Encoded:
    """One encoded value: the frame bytes and what every receiver will reconstruct from them."""

    payload: bytes
    decoded: torch.Tensor  # float32, same shape as the input


class ErrorFeedback:
    """Residuals keyed by what they compensate (e.g. ``"send/2"``: the share sent to rank 2).

    Not thread-safe: one step at a time (the codec reuses scratch buffers).
    """

    def __init__(self, codec: TensorCodec) -> None:
        self.codec = codec
        self.lossless = is_lossless(codec)
        self._residuals: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}

    def encode(self, key: str, x: torch.Tensor) -> Encoded:
        """Encode ``x`` plus ``key``'s residual; stage the new residual (``x`` is not modified)."""
        if self.lossless:
            return Encoded(encode_raw(x), x)  # fp32 frames reconstruct the input bit for bit
        residual = self._residuals.get(key)
        if residual is not None and residual.shape != x.shape:
            logger.warning(
                "error feedback %r: shape %s -> %s, residual dropped",
                key,
                tuple(residual.shape),
                tuple(x.shape),
            )
            residual = None
        y = x.float() + residual if residual is not None else x.float().clone()
        payload, decoded = self.codec.encode(y, reconstruct=True)
        assert decoded is not None
        self._staged[key] = y.sub_(decoded)  # e' = y - D(Q(y)), reusing y's memory
        return Encoded(payload, decoded)

    def commit(self) -> None:
        """The step succeeded everywhere it matters: staged residuals become current."""
        self._residuals.update(self._staged)
        self._staged.clear()

    def discard(self) -> None:
        """The step failed: forget staged residuals (a retry re-encodes the same values)."""
        self._staged.clear()

    def residual(self, key: str) -> torch.Tensor | None:
        return self._residuals.get(key)

    def reset(self) -> None:
        self._residuals.clear()
        self._staged.clear()

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Committed residuals (part of a stage checkpoint, so a resumed run keeps its compensation)."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {k: v.detach().float().clone() for k, v in state.items()}
        self._staged.clear()
