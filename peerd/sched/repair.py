"""Incremental re-planning after churn: repair the current allocation first, search only if it pays.

``repair`` keeps every surviving device in its (stage, replica) slot, drops the
replicas with the most holes when there are too few devices (spares allowed), and
fills each hole with the free device that fits it best (closest to its stage
mates and its pipeline neighbours); a short local search and an exact re-match
follow. ``replan`` then runs a fresh search seeded with the repair and adopts it
only when it is better by ``margin`` (hysteresis: a marginal gain is not worth
moving every stage's state across the network).
"""

from __future__ import annotations

import time

import numpy as np

from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.localsearch import LocalSearch
from peerd.sched.planner import PlanResult, make_objective, plan, result_for
from peerd.sched.problem import Problem, Shape, candidate_shapes
from peerd.sched.scenario import Scenario

log = get_logger(__name__)


def repair(
    scenario: Scenario,
    previous: Allocation,
    objective: str = "dtfm",
    *,
    seed: int = 0,
    time_budget: float = 2.0,
) -> PlanResult:
    """Patch ``previous`` for the current roster in ``scenario`` (fresh plan if the depth must change)."""
    start = time.monotonic()
    problem = Problem(scenario)
    shapes = candidate_shapes(scenario, allow_spares=objective == "peerd")
    shape = _target_shape(previous, shapes)
    if shape is None:
        result = plan(scenario, objective, seed=seed, time_budget=time_budget)
        result.note = f"pipeline depth {previous.d_pp} no longer possible: planned from scratch"
        return result
    obj = make_objective(problem, shape, objective)
    grid, lost = _surviving_grid(problem, previous, shape)
    free = [d for d in range(problem.n) if d not in set(grid[grid >= 0].tolist())]
    holes = int((grid < 0).sum())
    for k, j in np.argwhere(grid < 0):
        grid[k, j] = _best_fit(obj, grid, int(k), int(j), free)
        free.remove(int(grid[k, j]))
    spares = np.array(sorted(free), dtype=np.intp)
    ev = obj.evaluate(list(grid), spares, order=list(range(shape.d_pp)))
    rng = np.random.default_rng(seed)
    ev = LocalSearch(obj).run(ev, rng, deadline=start + time_budget)
    result = result_for(obj, ev, objective, seed, time.monotonic() - start)
    kept = sum(len(set(a) & set(b)) for a, b in zip(previous.stages, result.allocation.stages, strict=False))
    result.note = (
        f"repaired: {lost} devices gone, {holes} slots refilled, {shape.active - kept} tasklets moved"
    )
    return result


def replan(
    scenario: Scenario,
    previous: Allocation,
    objective: str = "dtfm",
    *,
    margin: float = 0.05,
    seed: int = 0,
    time_budget: float = 10.0,
) -> PlanResult:
    """Repair, then search from the repair; switch only for a gain of more than ``margin``."""
    start = time.monotonic()
    repaired = repair(scenario, previous, objective, seed=seed, time_budget=0.25 * time_budget)
    left = max(0.0, time_budget - (time.monotonic() - start))
    fresh = plan(scenario, objective, seed=seed, time_budget=left, initial=[repaired.allocation])
    if fresh.total < repaired.total * (1.0 - margin):
        fresh.note = (
            f"re-planned: {1 - fresh.total / repaired.total:.1%} better than the repair ({repaired.note})"
        )
        fresh.seconds = time.monotonic() - start
        return fresh
    repaired.note += (
        f"; kept (a fresh search gained {max(0.0, 1 - fresh.total / repaired.total):.1%} < {margin:.0%})"
    )
    repaired.seconds = time.monotonic() - start
    return repaired


def _target_shape(previous: Allocation, shapes: list[Shape]) -> Shape | None:
    """The previous shape if still allowed, else the same depth with the closest width."""
    same = Shape(previous.d_pp, previous.d_dp)
    if same in shapes:
        return same
    depth = [s for s in shapes if s.d_pp == previous.d_pp]
    if not depth:
        return None
    return min(depth, key=lambda s: (abs(s.d_dp - previous.d_dp), -s.d_dp))


def _surviving_grid(problem: Problem, previous: Allocation, shape: Shape) -> tuple[np.ndarray, int]:
    """Previous grid with -1 for departed devices, trimmed or widened to ``shape.d_dp`` columns."""
    rows = [[problem.index.get(d, -1) for d in stage] for stage in previous.stages]
    grid = np.array(rows, dtype=np.intp)
    lost = int((grid < 0).sum())
    if shape.d_dp < grid.shape[1]:
        holes = (grid < 0).sum(axis=0)
        keep = np.sort(np.argsort(holes, kind="stable")[: shape.d_dp])  # drop the most damaged replicas
        grid = grid[:, keep]
    elif shape.d_dp > grid.shape[1]:
        grid = np.hstack([grid, np.full((shape.d_pp, shape.d_dp - grid.shape[1]), -1, dtype=np.intp)])
    return grid, lost


def _best_fit(obj, grid: np.ndarray, k: int, j: int, free: list[int]) -> int:
    """The free device closest to row k's members and to its column neighbours."""
    cand = np.array(free, dtype=np.intp)
    score = np.zeros(len(cand))
    mates = grid[k][grid[k] >= 0]
    if len(mates):
        score += obj.affinity[np.ix_(cand, mates)].sum(axis=1)
    for r in (k - 1, k + 1):
        if 0 <= r < grid.shape[0] and grid[r, j] >= 0:
            score += obj.pair_cost[cand, grid[r, j]]
    return int(cand[int(np.argmin(score))])
