"""Deterministic example order: shuffling by (seed, epoch), global batches, replica shards, micro-batches.

The sampler is stateless given the step number: step ``s`` is batch ``s % steps_per_epoch`` of
epoch ``s // steps_per_epoch``, and epoch ``e``'s order (per replica ``r``) is a permutation drawn
from ``numpy.random.Generator(PCG64(SeedSequence([seed, e, r])))``. A checkpoint therefore only needs
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
    """Global batches of example ids for each training step, reshuffled every epoch.

    With ``replicas`` data-parallel replicas, example ``i`` always belongs to replica ``i % replicas``
    (sticky sharding): a replica shuffles only its own partition, by ``(seed, epoch, replica)``, and
    contributes ``global_batch / replicas`` ids to each step. Keeping an example on one replica keeps
    it on the same stage neighbours, so AC-SGD's per-example buffers stay where they were built.
    The global batch of a step is the concatenation of the replicas' slices, in replica order, which
    is what a single-process reference run trains on. Changing ``replicas`` changes the data order.
    """

    def __init__(self, num_examples: int, global_batch: int, seed: int = 0, replicas: int = 1) -> None:
        if global_batch < 1:
            raise ConfigError("global_batch", f"must be >= 1, got {global_batch}")
        if replicas < 1:
            raise ConfigError("replicas", f"must be >= 1, got {replicas}")
        if global_batch % replicas:
            raise ConfigError(
                "global_batch", f"{global_batch} does not split evenly over {replicas} replicas"
            )
        self.num_examples = num_examples
        self.global_batch = global_batch
        self.seed = seed
        self.replicas = replicas
        self.per_replica = global_batch // replicas
        # The smallest partition (num_examples // replicas ids) sets the epoch length.
        self.steps_per_epoch = (num_examples // replicas) // self.per_replica
        if self.steps_per_epoch < 1:
            raise ConfigError(
                "global_batch", f"{global_batch} is larger than the dataset ({num_examples} examples)"
            )

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a handful of samplers live for a whole run
    def epoch_order(self, epoch: int, replica: int = 0) -> np.ndarray:
        """Replica ``replica``'s example ids for ``epoch``, shuffled: int64, read-only."""
        if epoch < 0:
            raise ConfigError("epoch", f"must be >= 0, got {epoch}")
        self._check_replica(replica)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, replica])))
        part = np.arange(replica, self.num_examples, self.replicas, dtype=np.int64)
        order = part[rng.permutation(part.shape[0])]
        order.setflags(write=False)
        return order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of global step ``step``."""
        if step < 0:
            raise ConfigError("step", f"must be >= 0, got {step}")
        return divmod(step, self.steps_per_epoch)

    def replica_ids(self, step: int, replica: int) -> list[int]:
        """The ids of step ``step`` that data-parallel replica ``replica`` trains on."""
        self._check_replica(replica)
        epoch, k = self.position(step)
        order = self.epoch_order(epoch, replica)
        return [int(i) for i in order[k * self.per_replica : (k + 1) * self.per_replica]]

    def batch_ids(self, step: int) -> list[int]:
        """The ``global_batch`` ids of step ``step``: replica 0's slice, then replica 1's, ..."""
        return [i for r in range(self.replicas) for i in self.replica_ids(step, r)]

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.replicas:
            raise ConfigError("replica", f"must be in 0..{self.replicas - 1}, got {replica}")
