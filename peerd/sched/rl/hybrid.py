"""Hybrid search: successive halving over (task grouping, devices per group) arms, a deap GA below each arm.

Top levels are arms: a grouping of the workflow's units and a size per group (multiples of a
quantum that divides the device count; the rest idle). Rung 0 scores every arm by its greedy
seeds and keeps the best few plus the best arm of every grouping; each later rung gives every
surviving arm an equal share of the rung's evaluations of genetic search, then keeps the
better half, until one arm is left or the budget is spent.

Below an arm, an individual labels every device with its group (or idle); the arm fixes the
starting sizes. The GA (deap individuals and fitness) breeds by tournament, a uniform crossover
repaired back to the first parent's sizes, cross-group swaps of devices of different classes (a
swap inside a class changes nothing) and now and then a move of one device to another group or
to idle (so sizes can leave the arm's quantum grid); the layout of each task and the tasklet arrangement are then chosen exactly
for each group (``peerd.sched.rl.group``). Seeds are greedy: devices ordered region by region,
by TFLOPS, or by memory bandwidth, poured into the groups heaviest-first or generation-first.

Randomness comes only from numpy Generators seeded from (seed, arm): the result is
deterministic for a seed and an evaluation budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from deap import base, creator, tools

from peerd.log import get_logger
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping, Score
from peerd.sched.rl.workflow import KIND, ROLE

log = get_logger(__name__)

if not hasattr(creator, "RLFitness"):
    creator.create("RLFitness", base.Fitness, weights=(-1.0,))
    creator.create("RLIndividual", list, fitness=creator.RLFitness)


@dataclass
class HybridConfig:
    """Knobs of the hybrid search."""

    budget: int = 3000
    """Evaluations of genetic search over all rungs (the greedy seeds of rung 0 come on top)."""
    max_groups: int = 3
    """At most this many task groups."""
    quantum: int | None = None
    """Group sizes are multiples of this; default the largest divisor of N not above N / 8."""
    allow_idle: bool = True
    """Arms may leave some quanta of devices idle (a slow or badly linked device can cost more than it adds)."""
    survivors: int = 16
    """Arms kept after the seeds (rung 0): the best this many, plus the best arm of every grouping."""
    population: int = 8
    tournament: int = 3
    crossover_prob: float = 0.7
    swaps: float = 1.5
    """Mean number of cross-group swaps per child (at least one)."""
    move_prob: float = 0.5
    """Chance that a child also moves one device to another group or to idle: sizes drift off the
    arm's quantum grid (an arm is where its search starts, not a cage)."""
    polish: float = 0.25
    """Share of ``budget`` for the final local search: from the best plan of each grouping, moves of
    one, two or all devices of one class from one group (or idle) to another, while one improves."""
    seed: int = 0


@dataclass
class Arm:
    grouping: Grouping
    sizes: tuple[int, ...]
    index: int
    best: Score = field(default_factory=lambda: Score(math.inf))
    best_labels: list[int] | None = None
    population: list[Any] = field(default_factory=list)
    rng: np.random.Generator | None = None


@dataclass(frozen=True)
class HybridResult:
    grouping: Grouping
    labels: tuple[int, ...]
    """Group of each device (by position), -1 = idle."""
    score: Score
    arms: int
    rungs: int
    evaluations: int
    history: tuple[tuple[int, float], ...]
    """(evaluations so far, best seconds) after each rung: the quality-vs-budget curve."""


def default_quantum(n: int) -> int:
    return max(d for d in range(1, max(1, n // 8) + 1) if n % d == 0)


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered ways to write ``total`` as ``parts`` positive integers."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def search(ev: Evaluator, cfg: HybridConfig) -> HybridResult:
    """Run the hybrid search on ``ev``'s cluster and workload."""
    n = ev.cluster.n
    q = cfg.quantum or default_quantum(n)
    arms: list[Arm] = []
    extra = 1 if cfg.allow_idle else 0  # one more part, the idle devices, which may be empty
    for grouping in ev.workflow.groupings(cfg.max_groups):
        m = len(grouping)
        for parts in compositions(n // q + extra, m + extra) if n // q >= m else []:
            arms.append(Arm(grouping, tuple(p * q for p in parts[:m]), len(arms)))
    for arm in arms:
        arm.rng = np.random.default_rng([cfg.seed, arm.index])
        for labels in _seeds(ev, arm):
            _consider(ev, arm, labels)
    start = ev.evaluations
    ranked = sorted(arms, key=lambda a: (a.best.key, a.index))
    firsts = {a.grouping: a for a in reversed(ranked)}  # the best arm of each grouping
    keep = {a.index for a in ranked[: cfg.survivors]} | {a.index for a in firsts.values()}
    alive = [a for a in ranked if a.index in keep]
    rungs = max(1, math.ceil(math.log2(max(len(alive), 1))))
    history = [(0, float(alive[0].best.seconds))]
    polish_budget = int(cfg.budget * cfg.polish)
    genetic = cfg.budget - polish_budget
    for rung in range(rungs):
        share = max(1, (genetic // rungs) // len(alive))
        for arm in alive:
            _evolve(ev, arm, share, cfg)
        alive = sorted(alive, key=lambda a: (a.best.key, a.index))
        history.append((ev.evaluations - start, float(alive[0].best.seconds)))
        log.debug("rung %d: %d arms, best %.2f s", rung, len(alive), alive[0].best.seconds)
        if len(alive) == 1:
            break
        alive = alive[: max(1, math.ceil(len(alive) / 2))]
    # the halving may have dropped the right grouping early: polish each grouping's best plan
    ranked = sorted(arms, key=lambda a: (a.best.key, a.index))
    firsts = {a.grouping: a for a in reversed(ranked)}
    left = polish_budget
    for arm in sorted(firsts.values(), key=lambda a: (a.best.key, a.index)):
        if left <= 0:
            break
        left -= _polish(ev, arm, left)
    if polish_budget:
        history.append((ev.evaluations - start, float(min(a.best.key for a in arms))))
    winner = min(arms, key=lambda a: (a.best.key, a.index))
    assert winner.best_labels is not None, "every arm has at least one seed"
    return HybridResult(
        winner.grouping,
        tuple(winner.best_labels),
        winner.best,
        len(arms),
        rungs,
        ev.evaluations,
        tuple(history),
    )


def counts_of(ev: Evaluator, labels: list[int], groups: int) -> list[Counts]:
    arr = np.asarray(labels)
    return [ev.cluster.counts_of(np.flatnonzero(arr == g)) for g in range(groups)]


def _consider(ev: Evaluator, arm: Arm, labels: list[int]) -> Score:
    score = ev.score(arm.grouping, counts_of(ev, labels, len(arm.grouping)))
    if score.key < arm.best.key:
        arm.best, arm.best_labels = score, list(labels)
    ind = creator.RLIndividual(labels)
    ind.fitness.values = (score.key,)
    arm.population.append(ind)
    return score


def _demand(ev: Evaluator, tasks: tuple[str, ...]) -> float:
    """Relative FLOPs of a group's tasks (training counts 4x inference, generation 1x) for seeding order."""
    weight = {"train": 4.0, "infer": 1.0, "generate": 1.0}
    return sum(weight[KIND[t]] * ev.workload.model(ROLE[t]).params for t in tasks)


def _seeds(ev: Evaluator, arm: Arm) -> list[list[int]]:
    """Greedy labelings: three device orders x two group orders, duplicates dropped."""
    cl = ev.cluster
    region_flops: dict[str, float] = {}
    for i in range(cl.n):
        region_flops[cl.regions[i]] = region_flops.get(cl.regions[i], 0.0) + float(cl.flops[i])
    orders = [
        sorted(range(cl.n), key=lambda i: (-region_flops[cl.regions[i]], cl.regions[i], -cl.flops[i], i)),
        sorted(range(cl.n), key=lambda i: (-cl.flops[i], cl.regions[i], i)),
        sorted(range(cl.n), key=lambda i: (-cl.mem_bw[i], cl.regions[i], i)),
    ]
    groups = list(range(len(arm.grouping)))
    heavy = sorted(groups, key=lambda g: (-_demand(ev, arm.grouping[g]), g))
    gen_first = sorted(groups, key=lambda g: ("generate" not in arm.grouping[g], g))
    out, seen = [], set()
    for order in orders:
        for group_order in (heavy, gen_first):
            labels = [-1] * cl.n
            pos = 0
            for g in group_order:
                for i in order[pos : pos + arm.sizes[g]]:
                    labels[i] = g
                pos += arm.sizes[g]
            key = tuple(tuple(c) for c in counts_of(ev, labels, len(groups)))
            if key not in seen:
                seen.add(key)
                out.append(labels)
    return out


def _evolve(ev: Evaluator, arm: Arm, evaluations: int, cfg: HybridConfig) -> None:
    """``evaluations`` children of (mu + lambda) genetic search inside ``arm``."""
    rng = arm.rng
    assert rng is not None
    cls = ev.cluster.cls
    toolbox = base.Toolbox()
    toolbox.register("best", tools.selBest)
    for _ in range(evaluations):
        pop = arm.population
        p1 = _tournament(pop, cfg.tournament, rng)
        p2 = _tournament(pop, cfg.tournament, rng)
        child = list(p1)
        if rng.random() < cfg.crossover_prob and p1 != p2:
            mask = rng.random(len(child)) < 0.5
            child = [b if m else a for a, b, m in zip(p1, p2, mask, strict=True)]
            _repair(child, tuple(p1.count(g) for g in range(len(arm.sizes))), rng)
        for _ in range(1 + rng.poisson(max(cfg.swaps - 1.0, 0.0))):
            _swap(child, cls, rng)
        if rng.random() < cfg.move_prob:
            _move(child, cls, len(arm.sizes), rng)
        _consider(ev, arm, child)
        if len(arm.population) > cfg.population:
            arm.population = list(toolbox.best(arm.population, cfg.population))


def _polish(ev: Evaluator, arm: Arm, budget: int) -> int:
    """First-improvement descent from ``arm``'s best plan over moves of one class's devices; evaluations used.

    A plan's cost depends only on how many devices of each class each group holds, so a move is
    (class, from, to, how many): one, two or all of that class in the source group (or idle).
    The GA's random moves find such steps slowly once a plan is near a local optimum.
    """
    assert arm.best_labels is not None
    groups, cls = len(arm.grouping), ev.cluster.cls
    used, tried = 0, set()
    improved = True
    while improved and used < budget:
        improved = False
        labels = list(arm.best_labels)
        for c in range(ev.cluster.n_classes):
            for src in range(-1, groups):
                members = [i for i, (g, k) in enumerate(zip(labels, cls, strict=True)) if g == src and k == c]
                if src >= 0:  # a group keeps at least one device
                    limit = min(len(members), labels.count(src) - 1)
                else:
                    limit = len(members)
                for dst in range(-1, groups):
                    if dst == src:
                        continue
                    for k in sorted({1, 2, limit}):
                        if not 1 <= k <= limit or used >= budget:
                            continue
                        child = list(labels)
                        for i in members[-k:]:
                            child[i] = dst
                        key = tuple(tuple(x) for x in counts_of(ev, child, groups))
                        if key in tried:
                            continue
                        tried.add(key)
                        before = arm.best.key
                        _consider(ev, arm, child)
                        used += 1
                        if arm.best.key < before:
                            improved = True
                            break
                    if improved:
                        break
                if improved:
                    break
            if improved:
                break
    return used


def _tournament(pop: list[Any], k: int, rng: np.random.Generator) -> list[int]:
    picks = rng.choice(len(pop), size=min(k, len(pop)), replace=False)
    return pop[min(picks, key=lambda i: (pop[i].fitness.values[0], i))]


def _repair(labels: list[int], sizes: tuple[int, ...], rng: np.random.Generator) -> None:
    """Move random devices from groups over their size to groups under it (idle devices first)."""
    have = [labels.count(g) for g in range(len(sizes))]
    spare = [i for i, g in enumerate(labels) if g == -1]
    for g, size in enumerate(sizes):
        while have[g] > size:
            members = [i for i, x in enumerate(labels) if x == g]
            i = members[int(rng.integers(len(members)))]
            labels[i] = -1
            spare.append(i)
            have[g] -= 1
    for g, size in enumerate(sizes):
        while have[g] < size:
            i = spare.pop(int(rng.integers(len(spare))))
            labels[i] = g
            have[g] += 1


def _move(labels: list[int], cls: np.ndarray, groups: int, rng: np.random.Generator) -> None:
    """Move some devices of one class from one group (or idle) to another group or to idle.

    Moving several at once matters: dropping a whole node of slow GPUs one device at a time
    passes through sizes with poor layouts (a prime number of devices has few).
    """
    i = int(rng.integers(len(labels)))
    src, c = labels[i], cls[i]
    same = [j for j, g in enumerate(labels) if g == src and cls[j] == c]
    size = labels.count(src)
    limit = len(same) if src < 0 else min(len(same), size - 1)
    if limit < 1:
        return
    choices = [g for g in range(-1, groups) if g != src]
    dst = choices[int(rng.integers(len(choices)))]
    k = limit if rng.random() < 0.5 else int(rng.integers(1, limit + 1))  # often the whole block
    for j in rng.choice(same, size=k, replace=False):
        labels[int(j)] = dst


def _swap(labels: list[int], cls: np.ndarray, rng: np.random.Generator) -> None:
    """Exchange the groups of two devices of different groups and different classes (if any exist)."""
    n = len(labels)
    for _ in range(8):
        i, j = (int(x) for x in rng.choice(n, size=2, replace=False))
        if labels[i] != labels[j] and cls[i] != cls[j]:
            labels[i], labels[j] = labels[j], labels[i]
            return
