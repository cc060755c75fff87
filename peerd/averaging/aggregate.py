"""How a reducer combines the D contributions to its share: the robust-aggregation hook, and the sanity screen.

``Aggregator`` is the hook: given the decoded contributions of every member in rank order
(each a float32 vector of the share's length, all checked finite), it returns the combined
share. ``Mean`` is the default and what the cost model and the exactness tests assume: the
fixed-order sum divided by D, bit-identical to ``core.simulate``. ``ClippedMean`` is the
robust alternative: every contribution's L2 norm is first clipped to ``ratio`` times the
median contribution norm, so one member with a huge gradient moves the mean by at most
``ratio x median / D`` instead of arbitrarily (centred clipping à la Karimireddy et al. 2021
"Learning from History for Byzantine Robust Optimization" is the next step up and fits the
same hook). ``AGGREGATORS`` maps the config names to them.

``screen`` runs before any aggregator: a contribution from another member whose norm exceeds
``max_ratio`` times the norm of this member's whole gradient (the one input it can trust) is
refused with ``PeerMisbehaved(OUT_OF_RANGE)`` naming that member, so the step fails and the
runner suspects it, instead of averaging the absurd values into every replica.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Protocol

import torch

from peerd.errors import ConfigError, ErrorCode, PeerMisbehaved


class Aggregator(Protocol):
    """Combines the D contributions to one share (rank order) into that share's new value."""

    name: str

    def aggregate(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new float32 vector of the parts' length; never one of the inputs."""
        ...


def _ordered_mean(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float().clone() if len(parts) == 1 else torch.add(parts[0], parts[1])
    for part in parts[2:]:
        acc.add_(part)
    return acc.div_(len(parts))


class Mean:
    """``((c_0 + c_1) + ...) / D``: the plain mean in a fixed order (the default)."""

    name = "mean"

    def aggregate(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return _ordered_mean(parts)


class ClippedMean:
    """The mean after clipping each contribution's L2 norm to ``ratio`` x the median contribution norm."""

    name = "clipped"

    def __init__(self, ratio: float = 2.0) -> None:
        if not (math.isfinite(ratio) and ratio >= 1.0):
            raise ConfigError("aggregator.ratio", f"must be a finite number >= 1, got {ratio!r}")
        self.ratio = ratio

    def aggregate(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        norms = [float(torch.linalg.vector_norm(p)) for p in parts]
        bound = self.ratio * statistics.median(norms)
        clipped = [p * (bound / n) if n > bound > 0 else p for p, n in zip(parts, norms, strict=True)]
        return _ordered_mean(clipped)


AGGREGATORS: dict[str, type[Mean] | type[ClippedMean]] = {"mean": Mean, "clipped": ClippedMean}


def parse_aggregator(spec: Aggregator | str | None) -> Aggregator:
    """An aggregator by name (``mean``, ``clipped``) or as given; None is the mean."""
    if spec is None:
        return Mean()
    if isinstance(spec, str):
        cls = AGGREGATORS.get(spec.strip().lower())
        if cls is None:
            raise ConfigError("aggregator", f"unknown aggregator {spec!r} (one of {sorted(AGGREGATORS)})")
        return cls()
    return spec


def screen(
    parts: Sequence[torch.Tensor], own: int, scale: float, max_ratio: float, names: Sequence[str]
) -> None:
    """Refuse any other rank's contribution whose norm is above ``max_ratio`` x ``scale``, the norm
    of this member's whole gradient (not its part of this share).

    A contribution is a slice of its sender's whole gradient, so its norm is at most that whole
    gradient's, and honest replicas' whole gradients stay within a few tens of one another (a
    replica whose batch spikes: 25x in the wan bench's data-parallel arm). A share's own slice is
    no yardstick: there one replica's slice (of an embedding, say) was 1,600x another's, honestly.
    ``names[r]`` names rank ``r`` in the error. With a zero (or non-finite) scale there is nothing
    to judge by, so nothing is refused.
    """
    if not 0.0 < scale < float("inf"):
        return
    for rank, part in enumerate(parts):
        if rank == own:
            continue
        norm = float(torch.linalg.vector_norm(part))
        if not norm <= max_ratio * scale:  # also catches a NaN norm
            raise PeerMisbehaved(
                f"averaging contribution of rank {rank} ({names[rank]}) has norm {norm:.3g}, "
                f"{norm / scale:.3g}x this member's whole gradient's {scale:.3g} (bound {max_ratio:.3g}x)",
                peer=names[rank],
                code=ErrorCode.OUT_OF_RANGE,
            )
