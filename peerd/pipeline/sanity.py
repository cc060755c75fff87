"""Numeric sanity of tensors from pipeline neighbours: NaN/Inf and absurd magnitudes never reach the stage.

A decoded activation or activation gradient (after decompression, before the stage uses it)
must be finite, have no element above ``max_abs`` in magnitude, and an RMS at most
``rms_ratio`` times the median RMS of the last ``window`` messages of its kind this stream
accepted. A healthy fp32 pipeline stays orders of magnitude inside those bounds (GPT
activations sit at RMS ~1 after the first layer norm; activation gradients far below), while
a diverged or hostile neighbour's 1e30 or NaN would wreck the weights in one update. A
refusal is a ``PeerMisbehaved`` naming the sender: the receiving stage fails its step with
it and the runner suspects that peer (re-plan), since resending the same bytes cannot help.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from peerd.errors import ConfigError, ErrorCode, PeerMisbehaved


@dataclass(frozen=True)
class SanityConfig:
    """Bounds on the values a stage accepts from its neighbours."""

    max_abs: float = 1e6
    """Largest element magnitude accepted (fp32 training never needs more at a stage boundary)."""
    rms_ratio: float = 1e3
    """A message whose RMS exceeds this multiple of the recent median RMS of its kind is refused."""
    window: int = 32
    """Accepted messages per kind the median is taken over."""
    warmup: int = 4
    """Messages of a kind accepted before the relative bound applies (the first ones set the scale)."""

    def validate(self) -> None:
        for name in ("max_abs", "rms_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 1):
                raise ConfigError(f"sanity.{name}", f"must be a finite number > 1, got {value!r}")
        if self.window < 1 or self.warmup < 1 or self.warmup > self.window:
            raise ConfigError("sanity.warmup", "needs 1 <= warmup <= window")


def magnitude(t: torch.Tensor) -> tuple[float, float]:
    """``(max |x|, rms)`` of ``t`` in float64; NaN/Inf propagate into the max.

    CPU tensors go through numpy, which does not wake torch's intra-op pool (this may run on
    the event loop, see ``peerd.pipeline.codec.RawDecoder``).
    """
    if t.numel() == 0:
        return 0.0, 0.0
    if t.device.type == "cpu":
        if t.dtype not in (torch.float32, torch.float64):
            t = t.float()  # numpy has no bfloat16
        a = t.detach().reshape(-1).numpy()
        hi, lo = float(a.max()), float(a.min())  # NaN propagates into both
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return math.nan if math.isnan(hi) or math.isnan(lo) else math.inf, math.nan
        amax = max(hi, -lo)
        with np.errstate(over="ignore"):  # an overflow (inf) only happens far above any bound
            sq = float(np.dot(a, a))
    else:
        flat = t.detach().reshape(-1).float()
        amax = float(flat.abs().amax())
        if not math.isfinite(amax):
            return amax, math.nan
        sq = float(torch.dot(flat, flat))
    return amax, math.sqrt(sq / t.numel())


class NumericGuard:
    """Per-kind bounds of one receiving stage (decodes of one kind are serialized by the receiver)."""

    def __init__(self, cfg: SanityConfig | None = None) -> None:
        self.cfg = cfg or SanityConfig()
        self.cfg.validate()
        self._recent: dict[str, collections.deque[float]] = {}

    def check(self, kind: str, t: torch.Tensor, *, peer: str, what: str) -> None:
        """Raise ``PeerMisbehaved`` (NON_FINITE / OUT_OF_RANGE) naming ``peer`` unless ``t`` is sane."""
        amax, rms = magnitude(t)
        if not math.isfinite(amax):
            raise PeerMisbehaved(f"{what} from {peer} holds NaN or Inf", peer=peer, code=ErrorCode.NON_FINITE)
        if amax > self.cfg.max_abs:
            raise PeerMisbehaved(
                f"{what} from {peer}: max |x| = {amax:.3g} above the bound {self.cfg.max_abs:.3g}",
                peer=peer,
                code=ErrorCode.OUT_OF_RANGE,
            )
        recent = self._recent.setdefault(kind, collections.deque(maxlen=self.cfg.window))
        if len(recent) >= self.cfg.warmup:
            median = statistics.median(recent)
            if median > 0 and rms > self.cfg.rms_ratio * median:
                raise PeerMisbehaved(
                    f"{what} from {peer}: RMS {rms:.3g} is {rms / median:.3g}x the recent median {median:.3g} "
                    f"(bound {self.cfg.rms_ratio:.3g}x)",
                    peer=peer,
                    code=ErrorCode.OUT_OF_RANGE,
                )
        recent.append(rms)

    def reset(self) -> None:
        self._recent.clear()
