"""How much a job's activations shrink on the wire: AC-SGD's regime, from the visits per example.

AC-SGD sends the change of an example's activation since its last visit, quantized at
``forward_bits``; it needs that last visit buffered on both sides of the boundary. An example's
first visit has nothing to send a delta against, and neither has an example beyond the buffers'
room (``CompressionConfig.buffer_total_mb`` per boundary side): those go through the first-visit
codec (``CompressionSpec.first_visit``, direct 8-bit quantization by default). So the bytes
depend on how often examples come back:

- visits per example ``V = steps x global_batch / examples`` (the sampler walks the data in epochs,
  every example once per epoch);
- of the buffered examples a share ``min(1, w / V)`` of visits are first (warm-up) visits, ``w`` =
  the codec's warm-up visits (1); every visit of an unbuffered example is;
- activations' wire ratio to fp32 = ``f r_first + (1 - f) r_delta``, with ``f`` the share of
  first-visit codec rows over all and ``r = bits / 32``.

A single pass (``V <= 1``) sends every activation through the first-visit codec: that is direct
quantization, not AC-SGD, and the planner prices it so (``peerd.jobs.scoring``). Unknown examples
(an ``hf`` source is not read at submit) are priced as a single pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerd.jobs.spec import FIRST_VISIT_BITS, JobSpec
from peerd.pipeline.codec import CompressionConfig

BYTES_PER_BUFFERED_VALUE = 4  # the buffers' storage (float32)


@dataclass(frozen=True)
class ActivationRegime:
    """What an ``acsgd`` job's activations will cost on the wire."""

    first_visit: str  # the first-visit codec
    delta_bits: int
    visits: float | None  # per example (None: examples unknown)
    buffered: int  # examples one boundary side can buffer
    first_share: float  # share of activation rows sent through the first-visit codec
    forward_ratio: float  # expected wire bytes over fp32

    @property
    def deltas_engage(self) -> bool:
        return self.first_share < 1.0

    def describe(self) -> str:
        """One sentence for ``peerd submit``, ``peerd status`` and logs."""
        shrink = f"activations {1 / self.forward_ratio:.1f}x smaller than fp32"
        if self.visits is None:
            return (
                f"examples unknown: priced as a single pass, every activation a first visit sent as "
                f"{self.first_visit} ({shrink})"
            )
        if not self.deltas_engage:
            return (
                f"single pass ({self.visits:.2f} visits per example): every activation is a first visit, "
                f"sent as {self.first_visit} ({shrink}); AC-SGD's {self.delta_bits}-bit deltas engage only "
                "when examples repeat"
            )
        return (
            f"examples repeat ({self.visits:.1f} visits each): {1 - self.first_share:.0%} of activations go as "
            f"{self.delta_bits}-bit AC-SGD deltas, first visits as {self.first_visit} ({shrink})"
        )


def visits_per_example(spec: JobSpec) -> float | None:
    """Visits each training example gets over the job (None where the examples are unknown)."""
    if spec.planning.examples is None:
        return None
    return spec.steps * spec.global_batch / spec.planning.examples


def activation_regime(spec: JobSpec, hidden: int | None = None) -> ActivationRegime | None:
    """The regime of ``spec``'s activations; None unless they go as AC-SGD deltas. ``hidden``: the
    model's width (read from the spec's model when not given)."""
    comp = spec.compression
    first = comp.first_visit_codec
    if first is None or comp.forward_bits is None:
        return None
    runtime = CompressionConfig()
    width = hidden if hidden is not None else spec.model.family().hidden
    buffered = int(runtime.buffer_total_mb * (1 << 20)) // (
        spec.data.seq_len * width * BYTES_PER_BUFFERED_VALUE
    )
    examples, visits = spec.planning.examples, visits_per_example(spec)
    share = 1.0  # unknown examples: a single pass
    if examples is not None and visits is not None:
        held = min(1.0, buffered / examples)  # share of examples with a buffer
        share = 1.0 - held * max(0.0, 1.0 - min(1.0, runtime.warmup_visits / visits))
    r_first, r_delta = FIRST_VISIT_BITS[first] / 32, comp.forward_bits / 32
    return ActivationRegime(
        first_visit=first,
        delta_bits=comp.forward_bits,
        visits=visits,
        buffered=buffered,
        first_share=share,
        forward_ratio=share * r_first + (1.0 - share) * r_delta,
    )
