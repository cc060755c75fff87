"""What an ``rl`` job reports per iteration: rewards scored by the trainer, GRPO figures, drops, staleness, time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peerd.rl.rollout import RolloutGroup
from peerd.rl.tasks import Task

PHASES = ("wait", "score", "reference", "train", "publish", "checkpoint")
"""The trainer's phases of an iteration, back to back; ``generate`` (the slowest shard's sampling, as
its rollout peer reported it) overlaps ``wait``, and with data-parallel trainers ``average`` (their
gradient averages) and its part ``average_wait`` (the wait for the other trainers) lie in ``train``."""


def score(task: Task, groups: list[RolloutGroup]) -> None:
    """Score every completion with the task's verifier (the trainer never takes a peer's reward)."""
    for g in groups:
        g.scores = [task.score(g.problem, c) for c in g.completions]


@dataclass
class IterationReport:
    """One GRPO iteration of an ``rl`` job, as the trainer saw it."""

    iteration: int
    version: int
    """Policy version after this iteration's update (= iteration + 1)."""
    reward_mean: float
    pass_rate: float
    """Share of the completions trained on that are exactly correct."""
    format_rate: float
    kl: float
    """Mean k3 KL to the reference over completion tokens, before this iteration's updates."""
    loss: float
    clip_fraction: float
    response_len: float
    """Mean completion length in tokens (end marker included)."""
    rollouts: int
    """Completions trained on."""
    updates: int
    shards: int
    """Shards trained on."""
    shards_missing: int = 0
    """Shards of this iteration that had not arrived when the trainer stopped waiting (dropped)."""
    shards_covered: int = 0
    """Shards of absent rollout peers the trainer sampled itself (``TrainerConfig.cover_absent``)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Version lag (iteration - rollout version) -> completions trained on with it."""
    dropped_stale: int = 0
    """Completions refused since the last report because their version was older than allowed."""
    dropped_late: int = 0
    """Completions refused since the last report because their iteration was trained already."""
    weight_sync_bytes: int = 0
    """Weight bytes served to rollout peers since the last report."""
    averaging_bytes: int = 0
    """Bytes this trainer sent to average with the other data-parallel trainers since the last report."""
    averaging_raw_bytes: int = 0
    """What those would have been as raw fp32 (more than ``averaging_bytes`` when gradients are compressed)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (``PHASES``, ``generate`` when the shards said, ``average`` and
    ``average_wait`` with data-parallel trainers)."""
    rollouts_per_s: float = 0.0
    """Completions trained on per second of this iteration's wall-clock time."""

    @classmethod
    def of(cls, iteration: int, version: int, rewards: Rewards, **figures: Any) -> IterationReport:
        return cls(iteration=iteration, version=version, **vars(rewards), **figures)


@dataclass(frozen=True)
class Rewards:
    """The reward figures of one iteration's scored completions."""

    reward_mean: float
    pass_rate: float
    format_rate: float
    response_len: float


def summarize(groups: list[RolloutGroup]) -> Rewards:
    """The reward figures of scored ``groups`` (zeros when there are none)."""
    scores = [s for g in groups for s in g.scores]
    lens = [len(c) for g in groups for c in g.completions]
    n = max(1, len(scores))
    return Rewards(
        reward_mean=sum(s.reward for s in scores) / n,
        pass_rate=sum(s.correct for s in scores) / n,
        format_rate=sum(s.well_formed for s in scores) / n,
        response_len=sum(lens) / max(1, len(lens)),
    )
