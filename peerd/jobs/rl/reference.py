"""The single-process reference of an ``rl`` job's synchronous, sharded iteration (what swarm runs are checked against).

Iteration ``t`` of a sync job (``staleness: 0``) with ``trainers`` data-parallel trainers and
``n`` rollout peers: every shard of ``assign_shards`` is sampled from the policy of version ``t``
with its own generator (``RLPlan.generator``), the groups are laid out in shard order (trainer
by trainer), scored with the task's verifier and trained by the same ``Learner`` the trainer
peers run, each update the mean of every trainer's share (``Learner.train``'s ``replicas``). A
swarm run of one trainer that moved the same weights and completions through the wire
reproduces it bit for bit; one of several trainers up to float rounding (their gradients are
summed in another order).
"""

from __future__ import annotations

import torch

from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.report import IterationReport, score, summarize
from peerd.jobs.rl.shards import RLPlan, assign_shards, sample_shard
from peerd.rl.rollout import RolloutGroup


def reference_run(
    plan: RLPlan,
    rollout_peers: int,
    iterations: int | None = None,
    device: torch.device | str = "cpu",
    trainers: int = 1,
) -> list[IterationReport]:
    """``iterations`` (default: the job's) synchronous iterations of ``trainers`` trainers and
    ``rollout_peers`` rollout peers on ``device``."""
    learner = Learner(plan, device)
    learner.warm_up()
    layout = assign_shards(plan.prompts, trainers, [f"{i:08d}" for i in range(rollout_peers)])
    shards = len(layout)
    out = []
    for t in range(plan.iterations if iterations is None else iterations):
        groups: list[RolloutGroup] = []
        for shard in layout:
            if shard.problems:
                groups += sample_shard(learner.policy, plan, t, shard.index, shard.problems, learner.version)
        score(plan.task, groups)
        held = [sum(len(s.problems) for s in layout if s.trainer == r) for r in range(trainers)]
        figures = learner.train(groups, held if trainers > 1 else None)
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
