"""An rl job's GRPO figures in its trainer's progress record, and back out of it for ``peerd status``.

``RunFigures`` folds the trainer's per-iteration reports, one at a time as they come, into the
record's ``RLFigures``: the reward and pass-rate curve downsampled like the loss curve, run totals
of drops, staleness and weight-sync bytes, the latest and the largest KL, the latest length and
rate, the median seconds of each phase. ``summary`` turns the records a daemon reads into the
``progress.rl`` section of a job view (``peerd status --json``, the panel, ``/metrics``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
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


class RunningMedian:
    """The median of the values added so far (``statistics.median``'s: the mean of the two middle
    ones for an even count), in O(log n) per value: a max-heap of the lower half, a min-heap of the
    upper half."""

    def __init__(self) -> None:
        self._low: list[float] = []  # negated
        self._high: list[float] = []

    def add(self, value: float) -> None:
        if self._low and value > -self._low[0]:
            heapq.heappush(self._high, value)
        else:
            heapq.heappush(self._low, -value)
        if len(self._low) > len(self._high) + 1:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        elif len(self._high) > len(self._low):
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def value(self) -> float:
        if not self._low:
            raise ValueError("no values")
        if len(self._low) > len(self._high):
            return -self._low[0]
        return (-self._low[0] + self._high[0]) / 2.0


class RunFigures:
    """The trainer's run folded one report at a time, so a record costs the same at iteration 10 and
    at iteration 100,000: the progress publisher builds one every second or so, on the event loop
    that also feeds the trainer's compute thread."""

    def __init__(self) -> None:
        self.curve: list[tuple[int, float, float]] = []  # (iterations done, reward mean, pass rate)
        self.losses: list[tuple[int, float]] = []  # (iteration index, GRPO loss)
        self.last: IterationReport | None = None
        self.kl_max: float | None = None
        self.lags: dict[int, int] = {}
        self.dropped_stale = self.dropped_late = self.shards_missing = self.weight_sync_bytes = 0
        self.averaging_bytes = self.averaging_raw_bytes = 0  # the record's ``bytes``, not its ``rl`` map
        # the first iteration waits for the first rollouts of the run: the steady figures leave it out
        self._seen = 0
        self._steady_rollouts = 0
        self._steady_busy_s = 0.0
        self._phases: dict[str, RunningMedian] = {}

    @classmethod
    def of(cls, reports: Iterable[IterationReport]) -> RunFigures:
        run = cls()
        for r in reports:
            run.add(r)
        return run

    def add(self, r: IterationReport) -> None:
        self.curve.append((r.iteration + 1, r.reward_mean, r.pass_rate))
        self.losses.append((r.iteration, r.loss))
        self.last = r
        self.kl_max = r.kl if self.kl_max is None else max(self.kl_max, r.kl)
        for lag, n in r.staleness.items():
            self.lags[lag] = self.lags.get(lag, 0) + n
        self.dropped_stale += r.dropped_stale
        self.dropped_late += r.dropped_late
        self.shards_missing += r.shards_missing
        self.weight_sync_bytes += r.weight_sync_bytes
        self.averaging_bytes += r.averaging_bytes
        self.averaging_raw_bytes += r.averaging_raw_bytes
        self._seen += 1
        if self._seen > 1 and r.rollouts_per_s > 0:
            self._steady_rollouts += r.rollouts
            self._steady_busy_s += r.rollouts / r.rollouts_per_s
            for phase, seconds in r.seconds.items():
                self._phases.setdefault(phase, RunningMedian()).add(seconds)

    def figures(self, version: int) -> RLFigures:
        """The record's figures for the trainer's policy ``version`` (see the module docstring)."""
        last = self.last
        names = sorted(self._phases)[:MAX_PHASES]
        return RLFigures(
            version=version,
            rewards=downsample(self.curve, MAX_LOSS_POINTS),
            kl=last.kl if last else 0.0,
            kl_max=self.kl_max,
            response_len=last.response_len if last else 0.0,
            rollouts_per_s=last.rollouts_per_s if last else 0.0,
            steady_rollouts_per_s=self._steady_rollouts / self._steady_busy_s
            if self._steady_busy_s > 0
            else None,
            staleness=tuple(sorted((lag, n) for lag, n in self.lags.items() if lag < MAX_STALENESS_BINS)),
            dropped_stale=self.dropped_stale,
            dropped_late=self.dropped_late,
            shards_missing=self.shards_missing,
            weight_sync_bytes=self.weight_sync_bytes,
            phases_s={k: self._phases[k].value() for k in names} if names else None,
        )


def figures(reports: Iterable[IterationReport], version: int) -> RLFigures:
    """The record's figures after ``reports`` (every iteration so far, oldest first)."""
    return RunFigures.of(reports).figures(version)


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
        # over every trainer's record: a successor's covers only the iterations it trained
        "kl_max": max((r.rl.kl_max for r in ordered if r.rl and r.rl.kl_max is not None), default=None),
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
