"""Ops that cost more than their launch and memory traffic, per family: their units and unit costs.

On a CPU the tanh GELU, the exponentials of a softmax and a fused attention kernel's per-head
set-up run far below the memory bandwidth: at width 32 they cost a GPT's reference pass more
than its matmuls. The runtime's counts give the units of work of each family per sequence
(``peerd.models.launches.OpCounter.elements``: output elements, or attention heads), a device's
profile the nanoseconds one unit costs there beyond its launch and traffic; the RL cost model adds
``units x cost`` per sequence. Fields follow ``peerd.models.launches.ELEMENT_FAMILIES``.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Annotated

from peerd.loading import Range

NonNegative = Annotated[float, Range(ge=0)]


@dataclass(frozen=True)
class PerFamily:
    """One number per family: units of work (of a sequence), or nanoseconds per unit (of a device)."""

    gelu: NonNegative = 0.0
    """Output elements of a tanh GELU or its backward."""
    softmax: NonNegative = 0.0
    """Output elements of a softmax, log-softmax or exp."""
    attention: NonNegative = 0.0
    """Heads (batch x heads) of a fused attention forward."""
    attention_backward: NonNegative = 0.0
    """Heads of its backward."""

    def values(self) -> tuple[float, ...]:
        return astuple(self)

    def seconds(self, ns_per_unit: PerFamily) -> float:
        """Seconds of these units at ``ns_per_unit``."""
        return 1e-9 * sum(u * c for u, c in zip(self.values(), ns_per_unit.values(), strict=True))
