"""Deterministic example order: shuffling by (seed, epoch), global batches, replica shards, micro-batches.

The sampler is stateless given the step number: step ``s`` is batch ``s % steps_per_epoch`` of
epoch ``s // steps_per_epoch``, and epoch ``e``'s order is a permutation drawn from
``numpy.random.Generator(PCG64(SeedSequence([seed, e])))``. A checkpoint therefore only needs
the step to resume the exact data order, and every peer computes the same ids without talking.
Incomplete final batches of an epoch are dropped so every step has ``global_batch`` examples.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from peerd.errors import ConfigError


def micro_batches(ids: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` ids (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ConfigError("micro_batch_size", f"must be >= 1, got {micro_batch_size}")
    ids = list(ids)
    return [ids[i : i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]


def shard(ids: Sequence[int], replica: int, replicas: int) -> list[int]:
    """Replica ``replica`` of ``replicas``'s contiguous, disjoint slice of a global batch."""
    if replicas < 1:
        raise ConfigError("replicas", f"must be >= 1, got {replicas}")
    if not 0 <= replica < replicas:
        raise ConfigError("replica", f"must be in 0..{replicas - 1}, got {replica}")
    if len(ids) % replicas:
        raise ConfigError("global_batch", f"{len(ids)} examples do not split evenly over {replicas} replicas")
    per = len(ids) // replicas
    return list(ids[replica * per : (replica + 1) * per])


class EpochSampler:
    """Global batches of example ids for each training step, reshuffled every epoch."""

    def __init__(self, num_examples: int, global_batch: int, seed: int = 0) -> None:
        if global_batch < 1:
            raise ConfigError("global_batch", f"must be >= 1, got {global_batch}")
        if num_examples < global_batch:
            raise ConfigError(
                "global_batch", f"{global_batch} is larger than the dataset ({num_examples} examples)"
            )
        self.num_examples = num_examples
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = num_examples // global_batch

    @functools.lru_cache(maxsize=2)  # noqa: B019 - a handful of samplers live for a whole run
    def epoch_order(self, epoch: int) -> np.ndarray:
        """(num_examples,) int64 permutation of example ids for ``epoch``."""
        if epoch < 0:
            raise ConfigError("epoch", f"must be >= 0, got {epoch}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        order = rng.permutation(self.num_examples).astype(np.int64)
        order.setflags(write=False)
        return order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of global step ``step``."""
        if step < 0:
            raise ConfigError("step", f"must be >= 0, got {step}")
        return divmod(step, self.steps_per_epoch)

    def batch_ids(self, step: int) -> list[int]:
        """The ``global_batch`` example ids of step ``step``, in batch order."""
        epoch, k = self.position(step)
        order = self.epoch_order(epoch)
        return [int(i) for i in order[k * self.global_batch : (k + 1) * self.global_batch]]

    def replica_ids(self, step: int, replica: int, replicas: int) -> list[int]:
        """The slice of step ``step``'s batch that data-parallel replica ``replica`` trains on."""
        return shard(self.batch_ids(step), replica, replicas)
