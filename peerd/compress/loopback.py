"""In-process stage boundaries through real encoded bytes: forward AC-SGD (or direct) codec, backward codec.

``LoopbackHook`` has the ``activations`` / ``gradients`` methods of the single-process
pipeline executor's boundary hook: every tensor crossing a boundary is encoded to bytes and
decoded again by a separate receiver object, exactly as two peers would. It counts the
bytes, so experiments report wire volume next to loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from peerd.compress.codecs import TensorCodec, make_codec
from peerd.compress.delta import DeltaConfig, DeltaDecoder, DeltaEncoder
from peerd.compress.quant import QuantConfig


@dataclass
class BoundaryStats:
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_elements: int = 0
    backward_elements: int = 0

    @property
    def forward_bits_per_element(self) -> float:
        return 8 * self.forward_bytes / max(1, self.forward_elements)

    @property
    def backward_bits_per_element(self) -> float:
        return 8 * self.backward_bytes / max(1, self.backward_elements)


@dataclass
class _Side:
    """One boundary: a sender and a receiver that share nothing but bytes."""

    encoder: DeltaEncoder | None = None
    decoder: DeltaDecoder | None = None
    stats: BoundaryStats = field(default_factory=BoundaryStats)


class LoopbackHook:
    """Boundary hook that really encodes: ``forward`` is a DeltaConfig (AC-SGD) or a codec name.

    ``forward_quant`` configures a named quantizing forward codec (direct quantization);
    ``backward`` names the gradient codec (``backward_quant`` configures it).
    """

    def __init__(
        self,
        forward: DeltaConfig | str = "fp32",
        backward: str = "fp32",
        *,
        forward_quant: QuantConfig | None = None,
        backward_quant: QuantConfig | None = None,
    ) -> None:
        self.forward = forward
        self._fw_codec: TensorCodec | None = (
            None if isinstance(forward, DeltaConfig) else make_codec(forward, forward_quant)
        )
        self._bw_codec = make_codec(backward, backward_quant)
        self._sides: dict[int, _Side] = {}

    def _side(self, boundary: int) -> _Side:
        side = self._sides.get(boundary)
        if side is None:
            side = _Side()
            if isinstance(self.forward, DeltaConfig):
                side.encoder, side.decoder = DeltaEncoder(self.forward), DeltaDecoder(self.forward)
            self._sides[boundary] = side
        return side

    def activations(self, boundary: int, example_ids: Sequence[int], acts_BTC: torch.Tensor) -> torch.Tensor:
        side = self._side(boundary)
        if side.encoder is not None and side.decoder is not None:
            data = side.encoder.encode(acts_BTC, example_ids)
            out, _ = side.decoder.decode(data)
        else:
            assert self._fw_codec is not None
            data, _ = self._fw_codec.encode(acts_BTC)
            out = self._fw_codec.decode(data)
        side.stats.forward_bytes += len(data)
        side.stats.forward_elements += acts_BTC.numel()
        return out

    def gradients(self, boundary: int, example_ids: Sequence[int], grads_BTC: torch.Tensor) -> torch.Tensor:
        side = self._side(boundary)
        data, _ = self._bw_codec.encode(grads_BTC)
        side.stats.backward_bytes += len(data)
        side.stats.backward_elements += grads_BTC.numel()
        return self._bw_codec.decode(data)

    def stats(self) -> dict[int, BoundaryStats]:
        return {b: s.stats for b, s in sorted(self._sides.items())}

    def check_identical(self) -> bool:
        """Whether every boundary's sender and receiver buffers are bit-identical (tests, experiments)."""
        for side in self._sides.values():
            if side.encoder is None or side.decoder is None:
                continue
            enc, dec = side.encoder.store, side.decoder.store
            if len(enc) != len(dec):
                return False
            for ex in enc.ids():
                if ex not in dec or not torch.equal(enc.get(ex), dec.get(ex)):
                    return False
        return True

    def close(self) -> None:
        for side in self._sides.values():
            for part in (side.encoder, side.decoder):
                if part is not None:
                    part.close()
