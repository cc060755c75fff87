"""The scheduler's index-based view of a scenario: canonical device order, complete link matrices, shapes.

Devices are indexed in id-sorted order, so nothing downstream depends on the order
a scenario happens to list them in (the same roster always yields the same plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peerd.errors import ConfigError
from peerd.sched.hosts import HostShare
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
        self.devices = devices
        self.ids: list[str] = [d.id for d in devices]
        self.index: dict[str, int] = {d: k for k, d in enumerate(self.ids)}
        self.regions: list[str] = [d.region for d in devices]
        self.tflops = np.array([d.tflops for d in devices], dtype=float)
        self.memory_bytes = np.array([d.memory_gb * 1e9 for d in devices], dtype=float)
        self.hosts: list[HostShare | None] = [d.host for d in devices]
        # bit/s a device's flows share, where its scenario declares an access link (else inf)
        self.access_bps = np.array(
            [d.access_mbps * 1e6 if d.access_mbps is not None else np.inf for d in devices], dtype=float
        )
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


def candidate_shapes(
    scenario: Scenario, *, allow_spares: bool, whole_micro_batches: bool | None = None
) -> list[Shape]:
    """Shapes the training section allows for this roster, smallest first (ConfigError when there are none).

    Without spares (the ``dtfm`` yardstick) every device holds a tasklet: ``d_pp * d_dp == N``.
    With spares a shape needs at most N devices and the rest wait as spares; that holds for a
    fixed ``d_pp``/``d_dp`` pair too, so a roster larger than the job's shape still plans.
    ``whole_micro_batches`` (default: ``allow_spares``) keeps only widths whose replicas each
    run ``global_batch / d_dp`` examples as whole micro-batches, which is what the pipeline
    runtime can execute: a change of width then keeps the global batch and the training math.
    """
    n = len(scenario.devices)
    training = scenario.training
    if training is None:
        raise ConfigError("training", "is required to plan (batch size, d_pp, d_dp)")
    whole = allow_spares if whole_micro_batches is None else whole_micro_batches
    layers = scenario.model.layers if scenario.model is not None else None
    fixed_pp = None if training.d_pp == "auto" else int(training.d_pp)
    fixed_dp = None if training.d_dp == "auto" else int(training.d_dp)
    if fixed_pp is not None and layers is not None and fixed_pp > layers:
        raise ConfigError("training.d_pp", f"{fixed_pp} stages for a model of {layers} layers")
    shapes = []
    for d_pp in [fixed_pp] if fixed_pp else range(1, n + 1):
        if layers is not None and d_pp > layers:
            break
        for d_dp in [fixed_dp] if fixed_dp else range(1, n // d_pp + 1):
            if d_pp * d_dp > n or (not allow_spares and d_pp * d_dp != n):
                continue
            if whole and training.global_batch % (d_dp * training.micro_batch):
                continue
            shapes.append(Shape(d_pp, d_dp))
    if not shapes:
        raise _no_shape(
            n, fixed_pp, fixed_dp, allow_spares, whole, training.global_batch, training.micro_batch
        )
    return shapes


def _no_shape(
    n: int, d_pp: int | None, d_dp: int | None, spares: bool, whole: bool, batch: int, micro: int
) -> ConfigError:
    """Why no shape fits, naming the setting to change."""
    if d_pp is not None and d_dp is not None:
        need = d_pp * d_dp
        if need > n:
            return ConfigError(
                "training.d_dp",
                f"{n} devices but d_pp * d_dp = {d_pp} * {d_dp} = {need} tasklets need {need} devices",
            )
        if not spares and need != n:
            return ConfigError(
                "training.d_dp",
                f"{n} devices but d_pp * d_dp = {d_pp} * {d_dp} = {need} (this objective uses every "
                "device: no spares); fix the numbers or set one of them to auto",
            )
    if d_dp is not None and whole and batch % (d_dp * micro):
        return ConfigError(
            "training.global_batch",
            f"{batch} examples do not split into {d_dp} replicas x whole micro-batches of {micro}",
        )
    field = "training.d_dp" if d_dp else "training.d_pp"
    why = f"no pipeline shape fits {n} devices with these settings"
    if whole:
        why += f" (d_dp must divide global_batch / micro_batch = {batch} / {micro})"
    return ConfigError(field, why)
