"""Iteration time of a whole plan: groups' task times combined along the timing DAG, with transfers and sync.

A plan = a grouping (tuple of task groups) and the devices of each group. With each group's
task times (``peerd.sched.rl.group``), each path of ``workflow.timing_paths`` costs the sum of its
tasks, its transfers between groups (best pair, ``cost.transfer_time``) and, on a cycle path
whose generation and training sit apart, the weight sync. Then

- synchronous (k = 0): ``T = max over paths`` (the list schedule's makespan);
- async with staleness k ≥ 1: ``T = max(max_g busy_g, max over cycle paths / (k + 1))`` — each
  group works through its tasks once per period, and the generation → training → sync loop may
  span k + 1 periods. Weight sync runs on the network, off the GPUs.

``Evaluator`` caches group results by (tasks, devices per class), so searches pay for a group once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from peerd.sched.rl import cost
from peerd.sched.rl.cluster import Cluster
from peerd.sched.rl.group import GroupResult, Shortfall, evaluate_group
from peerd.sched.rl.workflow import Path, Workflow, timing_paths
from peerd.sched.rl.workload import Workload

Grouping = tuple[tuple[str, ...], ...]
Counts = tuple[int, ...]


@dataclass(frozen=True)
class Score:
    """Seconds per iteration of one plan (inf when infeasible, with the first shortfall)."""

    seconds: float
    shortfall: Shortfall | None = None

    @property
    def key(self) -> float:
        """A single number to minimise: seconds, or past every feasible plan by the missing GB."""
        if self.shortfall is None and math.isfinite(self.seconds):
            return self.seconds
        missing = self.shortfall.bytes if self.shortfall is not None else math.inf
        return 1e12 * (1.0 + missing / 1e9)


class Evaluator:
    """Scores plans of one cluster and workload; deterministic, counts its evaluations."""

    def __init__(self, cluster: Cluster, workload: Workload, balanced: bool = True) -> None:
        self.cluster, self.workload, self.balanced = cluster, workload, balanced
        self.workflow = Workflow.of(workload)
        self.evaluations = 0
        self._groups: dict[tuple[tuple[str, ...], Counts], GroupResult] = {}
        self._internal: dict[Counts, float] = {}
        self._paths: dict[Grouping, list[Path]] = {}
        reps = []
        for m in cluster.members:
            reps.append((m[0], m[1] if len(m) > 1 else None))
        c = cluster.n_classes
        self.class_delay = np.full((c, c), math.inf)
        self.class_bw = np.full((c, c), 1.0)
        for k in range(c):
            for j in range(c):
                a = reps[k][0]
                b = reps[j][0] if k != j else reps[k][1]
                if b is not None:
                    self.class_delay[k, j] = cluster.delay[a, b]
                    self.class_bw[k, j] = cluster.bw[a, b]
        const = workload.constants
        self.payload_bytes = {
            "tokens": workload.sequences * workload.seq_len * const.token_id_bytes,
            "scores": workload.sequences * workload.response_len * const.score_bytes,
        }
        self.sync_bytes = workload.actor.params * const.weight_bytes

    # --- pieces ------------------------------------------------------------------------------
    def group(self, tasks: tuple[str, ...], counts: Counts) -> GroupResult:
        key = (tasks, counts)
        if key not in self._groups:
            devices = self.cluster.devices_of(counts)
            self._groups[key] = evaluate_group(self.cluster, self.workload, tasks, devices, self.balanced)
        return self._groups[key]

    def paths(self, groups: Grouping) -> list[Path]:
        if groups not in self._paths:
            self._paths[groups] = timing_paths(self.workflow, groups)
        return self._paths[groups]

    def transfer(self, src: Counts, dst: Counts, nbytes: float) -> float:
        """Best-pair seconds to move ``nbytes`` from a group with class counts ``src`` to ``dst``."""
        a = np.flatnonzero(np.asarray(src) > 0)
        b = np.flatnonzero(np.asarray(dst) > 0)
        return cost.transfer_time(nbytes, self.class_delay[np.ix_(a, b)], self.class_bw[np.ix_(a, b)])

    def sync_internal(self, counts: Counts) -> float:
        if counts not in self._internal:
            devs = self.cluster.devices_of(counts)
            self._internal[counts] = cost.sync_internal(self.cluster, devs, self.sync_bytes)
        return self._internal[counts]

    def sync_time(self, groups: Grouping, counts: Sequence[Counts]) -> float:
        """Weight-sync seconds (0 when generation and actor training share their devices)."""
        g_gen = next(i for i, g in enumerate(groups) if "generate" in g)
        g_train = next(i for i, g in enumerate(groups) if "actor_train" in g)
        if g_gen == g_train:
            return 0.0
        host = self.host_time(counts[g_train], "publish") + self.host_time(counts[g_gen], "load")
        if self.workload.weight_sync == "star":
            senders = np.flatnonzero(np.asarray(counts[g_train]) > 0)
            return host + cost.sync_star(
                self.class_delay[senders], self.class_bw[senders], np.asarray(counts[g_gen]), self.sync_bytes
            )
        cross = self.transfer(counts[g_train], counts[g_gen], self.sync_bytes)
        return host + max(cross, self.sync_internal(counts[g_gen]))

    def host_time(self, counts: Counts, work: str) -> float:
        """Seconds the slowest device of a group with class counts ``counts`` takes for a weight
        sync's host ``work``: ``publish`` (a trainer packs the new weights) or ``load`` (a generator
        checks and loads them): ``Launches.<work>`` ops and ``<work>_bytes``."""
        n = self.workload.launches
        ops, nbytes = getattr(n, work), getattr(n, f"{work}_bytes")
        if not (ops or nbytes):
            return 0.0
        cl, eff = self.cluster, self.workload.constants.memory_efficiency
        return max(
            cost.host_work(ops, nbytes, float(cl.launch[d]), float(cl.mem_bw[d]) * eff)
            for d in cl.devices_of(counts)
        )

    # --- the whole plan ------------------------------------------------------------------------
    def score(self, groups: Grouping, counts: Sequence[Counts]) -> Score:
        """Seconds per iteration of ``groups`` holding ``counts`` devices of each class."""
        self.evaluations += 1
        results = [self.group(g, c) for g, c in zip(groups, counts, strict=True)]
        for r in results:
            if r.shortfall is not None:
                return Score(math.inf, r.shortfall)
        return Score(self.combine(groups, counts, results)["seconds"])

    def combine(self, groups: Grouping, counts: Sequence[Counts], results: list[GroupResult]) -> dict:
        """Iteration seconds and its parts: task seconds, transfers, sync, busy per group, critical path."""
        where = {t: i for i, g in enumerate(groups) for t in g}
        seconds = {t: results[where[t]].seconds(t) for t in where}
        sync = self.sync_time(groups, counts)
        transfers: dict[tuple[int, int, str], float] = {}
        best: tuple[float, Path | None] = (-1.0, None)
        best_cycle: tuple[float, Path | None] = (-1.0, None)
        for path in self.paths(groups):
            length = sum(seconds[t] for t in path.tasks)
            for edge in path.transfers:
                if edge not in transfers:
                    src, dst, payload = edge
                    transfers[edge] = self.transfer(counts[src], counts[dst], self.payload_bytes[payload])
                length += transfers[edge]
            length += sync if path.sync else 0.0
            if length > best[0]:
                best = (length, path)
            if path.cycle and length > best_cycle[0]:
                best_cycle = (length, path)
        busy = [r.busy for r in results]
        k = self.workload.staleness
        if k == 0:
            total, critical = best
        else:
            total = max(max(busy), best_cycle[0] / (k + 1))
            critical = best_cycle[1]
        return {
            "seconds": total,
            "tasks": seconds,
            "transfers": transfers,
            "sync": sync,
            "busy": busy,
            "critical_path": critical,
        }
