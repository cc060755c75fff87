"""The single-process reference of an ``rl`` job's synchronous, sharded iteration (what swarm runs are checked against).

Iteration ``t`` of a sync job (``staleness: 0``) with ``n`` rollout peers: every shard of
``shard_ranges(prompts, n)`` is sampled from the policy of version ``t`` with its own
generator (``RLPlan.generator``), the groups are laid out in shard order, scored with the
task's verifier and trained by the same ``Learner`` the trainer peer runs. A swarm run that
moved the same weights and completions through the wire reproduces it bit for bit.
"""

from __future__ import annotations

import torch

from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.report import IterationReport, score, summarize
from peerd.jobs.rl.shards import RLPlan, sample_shard, shard_ranges
from peerd.rl.rollout import RolloutGroup


def reference_run(
    plan: RLPlan, shards: int, iterations: int | None = None, device: torch.device | str = "cpu"
) -> list[IterationReport]:
    """``iterations`` (default: the job's) synchronous iterations with ``shards`` rollout shards on ``device``."""
    learner = Learner(plan, device)
    learner.warm_up()
    out = []
    for t in range(plan.iterations if iterations is None else iterations):
        groups: list[RolloutGroup] = []
        for s, indices in enumerate(shard_ranges(plan.prompts, shards)):
            if indices:
                groups += sample_shard(learner.policy, plan, t, s, indices, learner.version)
        score(plan.task, groups)
        figures = learner.train(groups)
        out.append(
            IterationReport.of(
                iteration=t,
                version=learner.version,
                kl=figures.kl,
                loss=figures.loss,
                clip_fraction=figures.clip_fraction,
                rollouts=sum(g.size for g in groups),
                updates=figures.updates,
                shards=shards,
                staleness={0: sum(g.size for g in groups)},
                rewards=summarize(groups),
            )
        )
    return out
