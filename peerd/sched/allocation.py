"""Allocations: stage -> ordered replicas -> device id, their canonical form and hash.

``stages[i][j]`` is the device running tasklet (stage i, replica j); pipeline j is
``[stages[0][j], stages[1][j], ...]``. Replicas are interchangeable, so the
canonical form orders them by their stage-0 device id; spares are sorted.
``digest()`` is the SHA-256 of the canonical JSON ``{"layers": ..., "spares": ...,
"stages": ...}`` (keys sorted, no whitespace): the same on every peer for the same
allocation, so consensus can vote on it. The plain form (``to_plain``) is lists of
device ids only, for migrants between islands and DHT records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from peerd.errors import ConfigError


@dataclass(frozen=True)
class Allocation:
    """Which device runs which tasklet, and which devices sit out."""

    stages: tuple[tuple[str, ...], ...]
    spares: tuple[str, ...] = ()
    layers: tuple[int, ...] | None = None
    """Layers held by each stage (uneven for uneven devices); None = even split."""

    @property
    def d_pp(self) -> int:
        return len(self.stages)

    @property
    def d_dp(self) -> int:
        return len(self.stages[0]) if self.stages else 0

    @property
    def devices(self) -> list[str]:
        return [d for stage in self.stages for d in stage]

    def pipelines(self) -> list[list[str]]:
        """Replica j's devices from the first stage to the last."""
        return [[stage[j] for stage in self.stages] for j in range(self.d_dp)]

    def canonical(self) -> Allocation:
        cols = sorted(range(self.d_dp), key=lambda j: self.stages[0][j])
        stages = tuple(tuple(stage[j] for j in cols) for stage in self.stages)
        return Allocation(stages, tuple(sorted(self.spares)), self.layers)

    def to_dict(self) -> dict[str, Any]:
        c = self.canonical()
        return {
            "layers": list(c.layers) if c.layers is not None else None,
            "spares": list(c.spares),
            "stages": [list(s) for s in c.stages],
        }

    def digest(self) -> str:
        """SHA-256 hex digest of the canonical JSON form."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def to_plain(self) -> list[list[str]]:
        return [list(s) for s in self.stages]

    @classmethod
    def from_plain(
        cls,
        stages: Sequence[Sequence[str]],
        spares: Sequence[str] = (),
        layers: Sequence[int] | None = None,
        *,
        known: Sequence[str] | None = None,
    ) -> Allocation:
        """Build and check an allocation from plain lists (ConfigError on malformed input)."""
        if not isinstance(stages, Sequence) or isinstance(stages, str) or not stages:
            raise ConfigError("stages", "must be a non-empty list of stages")
        width = None
        seen: set[str] = set()
        for i, stage in enumerate(stages):
            if not isinstance(stage, Sequence) or isinstance(stage, str) or not stage:
                raise ConfigError(f"stages[{i}]", "must be a non-empty list of device ids")
            if width is None:
                width = len(stage)
            elif len(stage) != width:
                raise ConfigError(f"stages[{i}]", f"has {len(stage)} replicas, stage 0 has {width}")
            for j, dev in enumerate(stage):
                _check_id(dev, f"stages[{i}][{j}]", seen)
        for k, dev in enumerate(spares):
            _check_id(dev, f"spares[{k}]", seen)
        if known is not None:
            unknown = sorted(seen - set(known))
            if unknown:
                raise ConfigError("stages", f"unknown device ids {unknown[:5]}")
        if layers is not None:
            layers = tuple(int(x) for x in layers)
            if len(layers) != len(stages) or min(layers) < 1:
                raise ConfigError("layers", f"must give >= 1 layer for each of the {len(stages)} stages")
        return cls(tuple(tuple(s) for s in stages), tuple(spares), layers)


def _check_id(dev: Any, field: str, seen: set[str]) -> None:
    if not isinstance(dev, str) or not dev:
        raise ConfigError(field, f"must be a device id string, got {dev!r}")
    if dev in seen:
        raise ConfigError(field, f"device {dev!r} appears twice")
    seen.add(dev)


def region_string(regions: Sequence[str]) -> str:
    """Compact run-length form of a pipeline's regions: ``Ohio x3 > Virginia x5``."""
    runs: list[list[Any]] = []
    for r in regions:
        if runs and runs[-1][0] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return " > ".join(f"{r} x{k}" if k > 1 else r for r, k in runs)
