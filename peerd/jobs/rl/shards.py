"""The pure plan of an ``rl`` job: its sizes, every iteration's problems, and which rollout peer samples which.

Any peer computes any shard from public data alone, so nothing but completions and weights
travels: problem ``i`` of iteration ``t`` comes from a ``random.Random`` seeded with
``(seed, t, i)``; the rollout peers (sorted by peer id) split an iteration's prompts into
contiguous shards; shard ``s`` of iteration ``t`` samples with a ``torch.Generator`` seeded
from ``(seed, t, s)``. Two runs with the same spec and the same number of rollout peers draw
the same problems and, from the same weights, the same completions bit for bit.

Policy version ``v`` is the policy after ``v`` iterations' updates (version 0: after the
warm-up). Iteration ``t`` trains version ``t`` into ``t + 1`` on rollouts of versions
``>= t - staleness``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from functools import cached_property

import torch

from peerd.jobs.spec import JobSpec
from peerd.models.gpt import GPT
from peerd.rl.rollout import RolloutGroup, rollout
from peerd.rl.spec import RLSpec
from peerd.rl.tasks import Problem, Task, make_task


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("/".join(str(p) for p in ("peerd-rl", *parts)).encode()).digest()


@dataclass(frozen=True)
class RLPlan:
    """An ``rl`` job's sizes as its runtime reads them (see ``peerd.rl.spec``)."""

    job_id: str
    spec: JobSpec

    @property
    def rl(self) -> RLSpec:
        return self.spec.rl_settings()

    @property
    def iterations(self) -> int:
        return self.spec.steps

    @property
    def group_size(self) -> int:
        return self.rl.group_size

    @property
    def prompts(self) -> int:
        """Prompts per iteration (each sampled ``group_size`` times)."""
        return self.spec.global_batch // self.rl.group_size

    @property
    def groups_per_update(self) -> int:
        return self.spec.micro_batch // self.rl.group_size

    @property
    def updates_per_iteration(self) -> int:
        """Optimizer updates of one pass over a whole iteration's rollouts."""
        return self.spec.global_batch // self.spec.micro_batch

    @property
    def total_updates(self) -> int:
        """What the LR schedule spans: every update of every epoch of every iteration."""
        return self.iterations * self.rl.epochs * self.updates_per_iteration

    @property
    def seed(self) -> int:
        return self.spec.model.seed

    @property
    def max_new_tokens(self) -> int:
        return self.rl.sampling.max_new_tokens

    @property
    def vocab_size(self) -> int:
        return self.spec.model.gpt_config().vocab_size

    @cached_property
    def params(self) -> int:
        """The policy's parameters (a tied weight counted once)."""
        family = self.spec.model.family()
        return sum(c.params for c in family.layer_costs(family.max_seq_len))

    @cached_property
    def weights_bound(self) -> int:
        """Most bytes a packed weights blob may take: fp32 weights twice over (a tied weight is sent
        under each of its names) plus the blob's index; a rollout peer refuses a bigger one before
        fetching it."""
        return 8 * self.params + (1 << 20)

    @cached_property
    def task(self) -> Task:
        return make_task(self.rl.task)

    def problem(self, iteration: int, index: int) -> Problem:
        """Problem ``index`` of ``iteration`` (the same on every peer)."""
        return self.task.sample(random.Random(_digest(self.seed, "problem", iteration, index)))

    def problems(self, iteration: int, indices: range) -> list[Problem]:
        return [self.problem(iteration, i) for i in indices]

    def generator(self, iteration: int, shard: int, device: torch.device | str = "cpu") -> torch.Generator:
        """The sampling generator of shard ``shard`` of ``iteration``, on the device that samples
        (draws are identical across peers of the same device type, not between cpu and cuda)."""
        seed = int.from_bytes(_digest(self.seed, "sample", iteration, shard)[:8], "big") >> 1
        return torch.Generator(device=device).manual_seed(seed)


def shard_ranges(prompts: int, shards: int) -> list[range]:
    """Prompt indices of each of ``shards`` contiguous, near-equal shards (some may be empty)."""
    assert shards >= 1
    bounds = [i * prompts // shards for i in range(shards + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class Shard:
    """One shard of every iteration: its problems, the trainer that trains on it, who samples it."""

    index: int
    """Its place in the iteration (shards are laid out in this order) and its sampling generator."""
    trainer: int
    """The replica index of the trainer that takes it."""
    sampler: str | None
    """The rollout peer that samples it; None: its trainer samples it itself (colocated)."""
    problems: range


def assign_shards(prompts: int, trainers: int, rollout_peers: list[str]) -> list[Shard]:
    """Every shard of an iteration with ``trainers`` data-parallel trainers and ``rollout_peers``.

    Trainer ``r`` trains on the ``r``-th of ``trainers`` near-equal contiguous prompt ranges. The
    rollout peers, sorted, are dealt round-robin: peer ``i`` samples for trainer ``i % trainers``,
    and a trainer's range is cut into one contiguous shard per rollout peer of its own, in order;
    a trainer without one samples its whole range itself. Shards are numbered trainer by trainer.
    With one trainer this is ``shard_ranges(prompts, len(rollout_peers))``, shard ``i`` the
    ``i``-th peer's.
    """
    assert trainers >= 1
    peers = sorted(rollout_peers)
    out: list[Shard] = []
    for r, owned in enumerate(shard_ranges(prompts, trainers)):
        mine = peers[r::trainers]
        cuts = shard_ranges(len(owned), max(len(mine), 1))
        samplers: list[str | None] = [*mine] or [None]
        for sampler, cut in zip(samplers, cuts, strict=True):
            problems = range(owned.start + cut.start, owned.start + cut.stop)
            out.append(Shard(len(out), r, sampler, problems))
    return out


def sample_shard(
    model: GPT, plan: RLPlan, iteration: int, shard: int, indices: range, version: int
) -> list[RolloutGroup]:
    """Shard ``shard`` of ``iteration`` (problems ``indices``), sampled by ``model`` of policy ``version``."""
    return rollout(
        model,
        plan.problems(iteration, indices),
        plan.group_size,
        plan.rl.sampling,
        plan.generator(iteration, shard, next(model.parameters()).device),
        version,
    )
