"""The RL scheduler's front door: plan a scenario (hybrid or exact), report the plan and the baselines.

``plan_rl`` returns an ``RLPlanResult`` whose ``to_dict`` is what ``peerd plan --kind rl --json``
prints: task groups with their devices and per-task layouts, the iteration time and its
breakdown, memory per device, and the verl-like and StreamRL-like predictions beside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from peerd.errors import ConfigError, InfeasibleError
from peerd.sched.rl.baselines import streamrl_like, verl_like_choice
from peerd.sched.rl.cluster import Cluster, RLScenario
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping
from peerd.sched.rl.exact import ExactConfig, solve
from peerd.sched.rl.group import evaluate_group
from peerd.sched.rl.hybrid import HybridConfig, search
from peerd.sched.rl.workload import Workload

Mode = Literal["hybrid", "exact"]


@dataclass(frozen=True)
class RLPlanResult:
    scenario: str
    workload: Workload
    mode: Mode
    grouping: Grouping
    devices: tuple[tuple[int, ...], ...]
    """Device positions of each group."""
    report: dict[str, Any]
    search: dict[str, Any]
    baselines: dict[str, dict[str, Any]]

    @property
    def seconds(self) -> float:
        return float(self.report["iteration_seconds"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "workload": self.workload.name,
            "algo": self.workload.algo,
            "staleness": self.workload.staleness,
            "mode": self.mode,
            **self.report,
            "search": self.search,
            "baselines": self.baselines,
        }


def with_overrides(workload: Workload, algo: str | None, staleness: int | None) -> Workload:
    """The workload with ``--algo`` / ``--async`` applied (``ConfigError`` names a bad value)."""
    if algo is not None:
        if algo not in ("grpo", "ppo"):
            raise ConfigError("algo", f"must be grpo or ppo, got {algo!r}")
        workload = dataclasses.replace(workload, algo=algo)  # type: ignore[arg-type]
    if staleness is not None:
        if staleness < 0:
            raise ConfigError("staleness", f"async staleness must be >= 0, got {staleness}")
        workload = dataclasses.replace(workload, staleness=staleness)
    return workload


def plan_rl(
    rl: RLScenario,
    mode: Mode = "hybrid",
    *,
    algo: str | None = None,
    staleness: int | None = None,
    seed: int = 0,
    budget: int = 3000,
    max_groups: int = 3,
    baselines: bool = True,
) -> RLPlanResult:
    """Plan ``rl``; raises ``InfeasibleError`` naming the task and shortfall when nothing fits."""
    workload = with_overrides(rl.workload, algo, staleness)
    cluster = Cluster.of(dataclasses.replace(rl, workload=workload))
    ev = Evaluator(cluster, workload)
    start = time.perf_counter()
    stats: dict[str, Any]
    if mode == "hybrid":
        h = search(ev, HybridConfig(budget=budget, max_groups=max_groups, seed=seed))
        grouping, score = h.grouping, h.score
        devices = tuple(tuple(i for i, g in enumerate(h.labels) if g == k) for k in range(len(grouping)))
        stats = {
            "arms": h.arms,
            "rungs": h.rungs,
            "evaluations": h.evaluations,
            "history": [[e, round(s, 4)] for e, s in h.history],
            "seed": seed,
            "budget": budget,
        }
    elif mode == "exact":
        x = solve(ev, ExactConfig(max_groups=max_groups))
        grouping, score = x.grouping, x.score
        devices = devices_for(cluster, x.counts)
        stats = {"columns": x.columns, "groupings": x.groupings, "lower_bound": x.lower_bound, "gap": x.gap}
    else:
        raise ConfigError("mode", f"must be hybrid or exact, got {mode!r}")
    stats["seconds"] = round(time.perf_counter() - start, 3)
    if score.shortfall is not None or not math.isfinite(score.seconds):
        raise InfeasibleError(f"no plan fits in memory on {rl.name or 'these devices'}: {score.shortfall}")
    report = describe(cluster, workload, grouping, devices)
    assert math.isclose(report["iteration_seconds"], score.seconds, rel_tol=1e-9), "report = search score"
    base = compare_baselines(cluster, workload, score.seconds) if baselines else {}
    return RLPlanResult(rl.name, workload, mode, grouping, devices, report, stats, base)


def devices_for(cluster: Cluster, counts: tuple[Counts, ...]) -> tuple[tuple[int, ...], ...]:
    """Concrete devices for per-group class counts: each class's members handed out in order."""
    taken = [0] * cluster.n_classes
    out = []
    for c in counts:
        mine: list[int] = []
        for k, n in enumerate(c):
            mine += cluster.members[k][taken[k] : taken[k] + n]
            taken[k] += n
        out.append(tuple(mine))
    return tuple(out)


def compare_baselines(cluster: Cluster, workload: Workload, seconds: float) -> dict[str, dict[str, Any]]:
    out = {}
    verl = verl_like_choice(cluster, workload)
    for name, (grouping, _, score) in (
        ("verl_like", (verl.grouping, verl.counts, verl.score)),
        ("streamrl_like", streamrl_like(cluster, workload)),
    ):
        entry: dict[str, Any] = {
            "iteration_seconds": _num(score.seconds),
            "feasible": score.shortfall is None,
        }
        if score.shortfall is not None:
            entry["shortfall"] = str(score.shortfall)
        entry["speedup"] = _num(score.seconds / seconds) if math.isfinite(score.seconds) else None
        entry["groups"] = [list(g) for g in grouping]
        if name == "verl_like":  # the verl configuration its time is for
            entry["config"] = verl.to_dict()
        out[name] = entry
    return out


def describe(
    cluster: Cluster, workload: Workload, grouping: Grouping, devices: tuple[tuple[int, ...], ...]
) -> dict:
    """The plan on its actual devices: groups, layouts, iteration time and parts, memory per device."""
    results = [evaluate_group(cluster, workload, g, list(d)) for g, d in zip(grouping, devices, strict=True)]
    for r in results:
        if r.shortfall is not None:
            raise InfeasibleError(f"no plan fits in memory: {r.shortfall}")
    ev = Evaluator(cluster, workload)
    counts = [cluster.counts_of(list(d)) for d in devices]
    parts = ev.combine(grouping, counts, results)
    used = set().union(*(set(d) for d in devices))
    memory = {}
    for r in results:
        for d, b in r.peak_bytes().items():
            memory[cluster.ids[d]] = {
                "used_gb": round(b / 1e9, 2),
                "usable_gb": round(cluster.memory[d] / 1e9, 2),
            }
    seconds = parts["seconds"]
    return {
        "iteration_seconds": seconds,
        "throughput": {
            "sequences_per_s": _num(workload.sequences / seconds),
            "tokens_per_s": _num(workload.sequences * workload.seq_len / seconds),
        },
        "groups": [
            {
                "tasks": list(g),
                "devices": [cluster.ids[i] for i in r.devices],
                "regions": _regions(cluster, r.devices),
                "busy_seconds": _num(r.busy),
                "layouts": {
                    t: {**p.layout.to_dict(), "seconds": _num(p.seconds)} for t, p in r.plans.items()
                },
            }
            for g, r in zip(grouping, results, strict=True)
        ],
        "breakdown": {
            "tasks": {t: _num(s) for t, s in parts["tasks"].items()},
            "transfers": [
                {"from": s, "to": d, "payload": p, "seconds": _num(v)}
                for (s, d, p), v in parts["transfers"].items()
            ],
            "weight_sync": _num(parts["sync"]),
            "critical_path": list(parts["critical_path"].tasks)
            + (["weight_sync"] if parts["critical_path"].sync else []),
        },
        "memory": memory,
        "idle": [cluster.ids[i] for i in range(cluster.n) if i not in used],
    }


def _regions(cluster: Cluster, devices: tuple[int, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in devices:
        out[cluster.regions[i]] = out.get(cluster.regions[i], 0) + 1
    return out


def _num(x: float) -> float:
    return round(float(x), 4)
