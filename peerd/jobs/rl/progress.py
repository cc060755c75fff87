"""An rl job's GRPO figures in its trainer's progress record, and back out of it for ``peerd status``.

``figures`` folds the trainer's per-iteration reports into the record's ``RLFigures`` (the
reward and pass-rate curve downsampled like the loss curve, run totals of drops, staleness and
weight-sync bytes, the latest KL, length and rate, the median seconds of each phase); ``summary`` turns the records a daemon reads
into the ``progress.rl`` section of a job view (``peerd status --json``, the panel, ``/metrics``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from peerd.jobs.records import (
    MAX_LOSS_POINTS,
    MAX_PHASES,
    MAX_STALENESS_BINS,
    Progress,
    RLFigures,
    downsample,
)
from peerd.jobs.rl.report import IterationReport


def figures(reports: Sequence[IterationReport], version: int) -> RLFigures:
    """The record's figures after ``reports`` (every iteration so far, oldest first)."""
    curve = [(r.iteration + 1, r.reward_mean, r.pass_rate) for r in reports]
    points = {i: (reward, rate) for i, reward, rate in curve}
    kept = downsample([(i, reward) for i, reward, _ in curve], MAX_LOSS_POINTS)
    lags: dict[int, int] = {}
    for r in reports:
        for lag, n in r.staleness.items():
            lags[lag] = lags.get(lag, 0) + n
    last = reports[-1] if reports else None
    # the first iteration waits for the first rollouts of the run: the steady rate leaves it out
    steady = [r for r in reports[1:] if r.rollouts_per_s > 0]
    busy_s = sum(r.rollouts / r.rollouts_per_s for r in steady)
    return RLFigures(
        version=version,
        rewards=tuple((i, points[i][0], points[i][1]) for i, _ in kept),
        kl=last.kl if last else 0.0,
        response_len=last.response_len if last else 0.0,
        rollouts_per_s=last.rollouts_per_s if last else 0.0,
        steady_rollouts_per_s=sum(r.rollouts for r in steady) / busy_s if busy_s > 0 else None,
        staleness=tuple(sorted((lag, n) for lag, n in lags.items() if lag < MAX_STALENESS_BINS)),
        dropped_stale=sum(r.dropped_stale for r in reports),
        dropped_late=sum(r.dropped_late for r in reports),
        shards_missing=sum(r.shards_missing for r in reports),
        weight_sync_bytes=sum(r.weight_sync_bytes for r in reports),
        phases_s=phase_medians(steady),
    )


def phase_medians(reports: Sequence[IterationReport]) -> dict[str, float] | None:
    """Median seconds of each phase over ``reports`` (None for none)."""
    names = sorted({k for r in reports for k in r.seconds})[:MAX_PHASES]
    if not names:
        return None
    return {k: statistics.median(r.seconds[k] for r in reports if k in r.seconds) for k in names}


def summary(records: Iterable[Progress]) -> dict[str, Any] | None:
    """``progress.rl`` of a job view: the newest trainer record's figures, the reward curve of all, the
    counts summed over the current trainers (None for jobs without any)."""
    found = [p for p in records if p.rl is not None]
    if not found:
        return None
    ordered = sorted(found, key=lambda r: r.recency)
    p = ordered[-1]
    rl = p.rl
    assert rl is not None
    # the curve over every trainer's record: after a hand-over the new trainer's record starts at
    # the iteration it resumed from, the earlier points live in the previous trainer's record
    # (the newer record wins an iteration both hold)
    points = {i: (reward, rate) for r in ordered for i, reward, rate in (r.rl.rewards if r.rl else ())}
    rewards = [(i, *points[i]) for i in sorted(points)]
    latest = rewards[-1] if rewards else None
    # data-parallel trainers count what their own rollout peers sent: the job's counts are the sum
    # over the current allocation's trainers (one record each)
    counts = [r.rl for r in {r.replica: r for r in ordered if r.epoch == p.epoch}.values() if r.rl]
    lags: dict[int, int] = {}
    for c in counts:
        for lag, n in c.staleness:
            lags[lag] = lags.get(lag, 0) + n
    return {
        "version": rl.version,
        "iteration": p.step,
        "reward_mean": latest[1] if latest else None,
        "pass_rate": latest[2] if latest else None,
        "rewards": [[i, round(r, 6), round(rate, 6)] for i, r, rate in rewards],
        "kl": rl.kl,
        "response_len": rl.response_len,
        "rollouts_per_s": rl.rollouts_per_s,
        "steady_rollouts_per_s": rl.steady_rollouts_per_s,
        "staleness": [[lag, lags[lag]] for lag in sorted(lags)],
        "dropped_stale": sum(c.dropped_stale for c in counts),
        "dropped_late": sum(c.dropped_late for c in counts),
        "shards_missing": sum(c.shards_missing for c in counts),
        "weight_sync_bytes": sum(c.weight_sync_bytes for c in counts),
        "phases_s": dict(rl.phases_s) if rl.phases_s is not None else None,
    }
