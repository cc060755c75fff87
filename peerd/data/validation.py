"""The validation split: which windows are held out from training, and which of them each replica evaluates.

The held-out windows are the last ones of the corpus (``ValidationConfig.windows``, or
``fraction`` of all windows), and training stops early enough that no training window shares
a byte with them (``WindowDataset`` drops the windows in between). Both follow from the corpus
and the spec alone, so every peer holds out the same windows without talking.

An evaluation covers the first ``batches × global_batch`` held-out windows, in id order, the
same set every time (so the curve compares like with like). Each of those global batches is
split over the data-parallel replicas like a training batch (contiguous shards, ``shard``) and
cut into micro-batches, so the mean over the replicas of their mean losses is the mean over the
whole evaluation set, whatever the number of replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from peerd.data.sampler import micro_batches, shard
from peerd.errors import ConfigError
from peerd.loading import Range

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ValidationConfig:
    """A held-out split and how often the job evaluates its loss (``data.validation``)."""

    windows: Annotated[int | None, Range(ge=1, le=INT32_MAX)] = None
    """Held-out windows at the end of the corpus (give this or ``fraction``)."""
    fraction: Annotated[float | None, Range(gt=0, lt=1)] = None
    """Share of the corpus's windows held out at its end, rounded down, at least one."""
    interval: Annotated[int, Range(ge=1, le=INT32_MAX)] = 100
    """Evaluate after every ``interval`` completed steps, and after the last step."""
    batches: Annotated[int, Range(ge=1, le=INT32_MAX)] = 1
    """Global batches of held-out windows per evaluation (the first ``batches × global_batch``)."""

    def problems(self) -> list[ConfigError]:
        if (self.windows is None) == (self.fraction is None):
            return [ConfigError("windows", "give exactly one of 'windows' and 'fraction'")]
        return []

    def held_out(self, total: int) -> int:
        """How many of ``total`` windows are held out."""
        if self.windows is not None:
            return self.windows
        assert self.fraction is not None  # problems() checked
        return max(1, int(self.fraction * total))

    def evaluates_after(self, completed: int, steps: int) -> bool:
        """Whether the job evaluates once ``completed`` steps are done (every ``interval``, and at the end)."""
        return completed >= 1 and (completed % self.interval == 0 or completed == steps)


def validation_micro_batches(
    held_out_ids: Sequence[int],
    cfg: ValidationConfig,
    *,
    global_batch: int,
    micro_batch: int,
    replica: int,
    replicas: int,
) -> list[list[int]]:
    """The micro-batches of held-out ids that replica ``replica`` of ``replicas`` evaluates."""
    need = cfg.batches * global_batch
    if need > len(held_out_ids):
        raise ConfigError(
            "data.validation.batches",
            f"{cfg.batches} x global_batch {global_batch} = {need} windows, "
            f"but only {len(held_out_ids)} are held out",
        )
    mine = [
        i
        for b in range(cfg.batches)
        for i in shard(held_out_ids[b * global_batch : (b + 1) * global_batch], replica, replicas)
    ]
    return micro_batches(mine, micro_batch)
