"""The scheduler's index-based view of a scenario: canonical device order, complete link matrices, shapes.

Devices are indexed in id-sorted order, so nothing downstream depends on the order
a scenario happens to list them in (the same roster always yields the same plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peerd.errors import ConfigError
from peerd.sched.scenario import Scenario


@dataclass(frozen=True, order=True)
class Shape:
    """Pipeline depth x data-parallel width; ``d_pp * d_dp`` devices hold tasklets."""

    d_pp: int
    d_dp: int

    @property
    def active(self) -> int:
        return self.d_pp * self.d_dp

    def __str__(self) -> str:
        return f"{self.d_pp}x{self.d_dp}"


class Problem:
    """Devices (id-sorted), their delay/bandwidth matrices without gaps, compute and memory."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        order = sorted(range(len(scenario.devices)), key=lambda i: scenario.devices[i].id)
        devices = [scenario.devices[i] for i in order]
        self.ids: list[str] = [d.id for d in devices]
        self.index: dict[str, int] = {d: k for k, d in enumerate(self.ids)}
        self.regions: list[str] = [d.region for d in devices]
        self.tflops = np.array([d.tflops for d in devices], dtype=float)
        self.memory_bytes = np.array([d.memory_gb * 1e9 for d in devices], dtype=float)
        ix = np.ix_(order, order)
        self.delay = np.ascontiguousarray(scenario.delay_matrix()[ix])  # (N, N) seconds
        self.bandwidth = np.ascontiguousarray(scenario.bandwidth_matrix()[ix])  # (N, N) bit/s
        missing = np.argwhere(np.isnan(self.delay) | np.isnan(self.bandwidth))
        if len(missing):
            i, j = missing[0]
            raise ConfigError(
                "links",
                f"{len(missing)} device pairs have no delay/bandwidth, e.g. {self.ids[i]!r} -> {self.ids[j]!r}; "
                "add links or region values, or set estimate_missing: true",
            )

    @property
    def n(self) -> int:
        return len(self.ids)

    def transfer_seconds(self, nbytes: float) -> np.ndarray:
        """Time to move ``nbytes`` over each directed link: delay + size / bandwidth, shape (N, N)."""
        t = self.delay + 8.0 * nbytes / self.bandwidth
        np.fill_diagonal(t, 0.0)
        return t


def candidate_shapes(scenario: Scenario, *, allow_spares: bool) -> list[Shape]:
    """Shapes the training section allows for this roster (ConfigError when there are none).

    A fixed ``d_pp``/``d_dp`` pair must use every device exactly; ``auto`` lets the
    scheduler choose. Without spares (the ``dtfm`` yardstick) ``d_pp * d_dp == N``.
    """
    n = len(scenario.devices)
    training = scenario.training
    if training is None:
        raise ConfigError("training", "is required to plan (batch size, d_pp, d_dp)")
    layers = scenario.model.layers if scenario.model is not None else None
    fixed_pp = None if training.d_pp == "auto" else int(training.d_pp)
    fixed_dp = None if training.d_dp == "auto" else int(training.d_dp)
    if fixed_pp is not None and fixed_dp is not None:
        if fixed_pp * fixed_dp != n:
            raise ConfigError(
                "training.d_dp",
                f"{n} devices but d_pp * d_dp = {fixed_pp} * {fixed_dp} = {fixed_pp * fixed_dp}; "
                "fix the numbers or set one of them to auto",
            )
        if layers is not None and fixed_pp > layers:
            raise ConfigError("training.d_pp", f"{fixed_pp} stages for a model of {layers} layers")
        return [Shape(fixed_pp, fixed_dp)]
    if fixed_pp is not None and layers is not None and fixed_pp > layers:
        raise ConfigError("training.d_pp", f"{fixed_pp} stages for a model of {layers} layers")
    shapes = []
    for d_pp in [fixed_pp] if fixed_pp else range(1, n + 1):
        if layers is not None and d_pp > layers:
            break
        dps = [fixed_dp] if fixed_dp else range(1, n // d_pp + 1)
        for d_dp in dps:
            if d_pp * d_dp > n or (not allow_spares and d_pp * d_dp != n):
                continue
            if allow_spares and training.global_batch % (d_dp * training.micro_batch):
                continue  # every replica runs whole micro-batches
            shapes.append(Shape(d_pp, d_dp))
    if not shapes:
        field = "training.d_dp" if fixed_dp else "training.d_pp"
        raise ConfigError(field, f"no pipeline shape fits {n} devices with these settings")
    return shapes
