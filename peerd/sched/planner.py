"""Plan an allocation for a scenario: choose the shape, run the evolutionary search, report the result.

``plan(scenario, objective, seed, time_budget)`` is what ``peerd plan`` and the
daemon's planner call. With ``auto`` shapes it screens every allowed (d_pp, d_dp)
with two cluster-aware constructions and searches the best few. The search stops
at the time budget, after ``generations``, or after ``patience`` generations
without improvement (whichever comes first; only the first depends on the
machine, so small problems give the same answer on every peer). The winner's
stage order is re-solved exactly (Held-Karp up to 16 stages) and the reported
cost is recomputed from the final allocation as written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from peerd.errors import ConfigError, InfeasibleError
from peerd.log import get_logger
from peerd.sched.allocation import Allocation, region_string
from peerd.sched.cost_dtfm import DtfmObjective
from peerd.sched.cost_peerd import INFEASIBLE, PeerdObjective
from peerd.sched.evolution import Island, SearchConfig
from peerd.sched.layout import score_allocation, to_allocation
from peerd.sched.objective import Cost, Evaluation, Objective
from peerd.sched.problem import Problem, Shape, candidate_shapes
from peerd.sched.scenario import Scenario
from peerd.sched.seeding import active_devices, device_chains, grid_groups

log = get_logger(__name__)

OBJECTIVES: dict[str, type[Objective]] = {"dtfm": DtfmObjective, "peerd": PeerdObjective}
SHAPES_SEARCHED = 3


@dataclass
class PlanResult:
    """An allocation with its cost breakdown and how it was found."""

    allocation: Allocation
    objective: str
    shape: Shape
    total: float
    parts: dict[str, float]
    seconds: float
    evaluations: int = 0
    generations: int = 0
    seed: int = 0
    history: list[float] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def digest(self) -> str:
        return self.allocation.digest()

    def to_dict(self) -> dict[str, Any]:
        alloc = self.allocation.canonical()
        return {
            "objective": self.objective,
            "shape": {"d_pp": self.shape.d_pp, "d_dp": self.shape.d_dp},
            "allocation": [list(s) for s in alloc.stages],
            "pipelines": alloc.pipelines(),
            "layers": list(alloc.layers) if alloc.layers is not None else None,
            "spares": list(alloc.spares),
            "regions": self.regions,
            "total": self.total,
            "dp": self.parts.get("dp"),
            "pp": self.parts.get("pp"),
            "parts": self.parts,
            "seconds": self.seconds,
            "evaluations": self.evaluations,
            "generations": self.generations,
            "seed": self.seed,
            "hash": self.digest,
            "note": self.note,
        }


def make_objective(problem: Problem, shape: Shape, objective: str) -> Objective:
    try:
        cls = OBJECTIVES[objective]
    except KeyError:
        raise ConfigError(
            "objective", f"unknown objective {objective!r} (choose from {sorted(OBJECTIVES)})"
        ) from None
    return cls(problem, shape)


def plan(
    scenario: Scenario,
    objective: str = "dtfm",
    *,
    seed: int = 0,
    time_budget: float = 10.0,
    generations: int | None = None,
    patience: int | None = 12,
    config: SearchConfig | None = None,
    initial: Sequence[Allocation] = (),
) -> PlanResult:
    """Search an allocation for ``scenario`` under ``objective`` ("dtfm" or "peerd")."""
    start = time.monotonic()
    deadline = start + time_budget
    if objective not in OBJECTIVES:
        raise ConfigError("objective", f"unknown objective {objective!r} (choose from {sorted(OBJECTIVES)})")
    problem = Problem(scenario)
    shapes = candidate_shapes(scenario, allow_spares=objective == "peerd")
    objectives = _screen_shapes(problem, shapes, objective, start + 0.2 * time_budget)
    best: tuple[Evaluation, Objective, Island] | None = None
    gens = 0
    for i, obj in enumerate(objectives):
        share = (deadline - time.monotonic()) / (len(objectives) - i)
        island_deadline = time.monotonic() + share
        seeds = [a for a in initial if (a.d_pp, a.d_dp) == (obj.shape.d_pp, obj.shape.d_dp)]
        island = Island(obj, _island_seed(seed, obj.shape), config, initial=seeds, deadline=island_deadline)
        _evolve(island, island_deadline, generations, patience)
        gens += island.generation
        ev = _polish(obj, island.best_evaluations(1)[0])
        if best is None or ev.cost.better_than(best[0].cost):
            best = (ev, obj, island)
    assert best is not None
    ev, obj, island = best
    return _result(obj, ev, objective, seed, time.monotonic() - start, gens, island.history)


def make_island(
    scenario: Scenario,
    objective: str = "dtfm",
    *,
    seed: int = 0,
    shape: Shape | None = None,
    shapes: Sequence[Shape] | None = None,
    config: SearchConfig | None = None,
    time_budget: float = 5.0,
) -> Island:
    """One island for ``scenario`` (e.g. one per peer in consensus): the given ``shape``, or the
    most promising of ``shapes`` (default: every shape ``candidate_shapes`` allows). Drive it with
    ``step``; exchange ``best(k)`` / ``accept(migrants)``."""
    problem = Problem(scenario)
    if shape is None:
        if shapes is None:
            shapes = candidate_shapes(scenario, allow_spares=objective == "peerd")
        if not shapes:
            raise ConfigError("training", "no pipeline shape to search")
        deadline = time.monotonic() + 0.2 * time_budget
        obj = _screen_shapes(problem, list(shapes), objective, deadline, keep=1)[0]
    else:
        obj = make_objective(problem, shape, objective)
    return Island(obj, _island_seed(seed, obj.shape), config, deadline=time.monotonic() + time_budget)


def score(scenario: Scenario, allocation: Allocation, objective: str = "dtfm") -> Cost:
    """Re-score someone else's allocation exactly as written (ConfigError if it does not fit the roster)."""
    shape = Shape(allocation.d_pp, allocation.d_dp)
    allowed = candidate_shapes(scenario, allow_spares=objective == "peerd")
    if shape not in allowed:
        raise ConfigError("stages", f"shape {shape} is not allowed for this roster and training section")
    return score_allocation(make_objective(Problem(scenario), shape, objective), allocation)


def result_for(
    obj: Objective, ev: Evaluation, objective: str, seed: int, seconds: float, note: str = ""
) -> PlanResult:
    """Package an evaluation as a PlanResult (used by repair too)."""
    return _result(obj, ev, objective, seed, seconds, 0, [ev.cost.total], note)


def _result(obj, ev, objective, seed, seconds, gens, history, note: str = "") -> PlanResult:
    alloc = to_allocation(obj, ev)
    cost = score_allocation(obj, alloc)
    assert abs(cost.total - ev.cost.total) <= 1e-6 * max(1.0, ev.cost.total), (cost.total, ev.cost.total)
    if cost.total >= INFEASIBLE:
        raise InfeasibleError(
            f"no allocation of {obj.problem.n} devices as {obj.shape} fits the model in memory "
            f"({int(cost.total / INFEASIBLE - 1)} layers left over)"
        )
    regions = obj.problem.scenario
    region_of = {d.id: d.region for d in regions.devices}
    return PlanResult(
        allocation=alloc,
        objective=objective,
        shape=obj.shape,
        total=cost.total,
        parts=dict(cost.parts),
        seconds=seconds,
        evaluations=obj.evaluations,
        generations=gens,
        seed=seed,
        history=list(history),
        regions=[region_string([region_of[d] for d in pipe]) for pipe in alloc.pipelines()],
        note=note,
    )


def _island_seed(seed: int, shape: Shape) -> int:
    return int(np.random.SeedSequence([seed, shape.d_pp, shape.d_dp]).generate_state(1)[0])


def _evolve(island: Island, deadline: float, generations: int | None, patience: int | None) -> None:
    best, since = island.best_cost(), 0
    while time.monotonic() < deadline:
        if generations is not None and island.generation >= generations:
            break
        island.step(1, deadline=deadline)
        if island.best_cost() < best - 1e-12 * max(1.0, best):
            best, since = island.best_cost(), 0
        else:
            since += 1
        if patience is not None and since >= patience:
            break


def _polish(obj: Objective, ev: Evaluation) -> Evaluation:
    """Re-solve the stage order exactly (when small enough) and keep the better one."""
    exact = obj.evaluate(ev.groups, ev.spares, exact=True)
    return exact if exact.cost.better_than(ev.cost) else ev


def _screen_shapes(
    problem: Problem, shapes: list[Shape], objective: str, deadline: float, keep: int = SHAPES_SEARCHED
) -> list[Objective]:
    """Objectives for the ``keep`` most promising shapes, best first (unranked when all are kept)."""
    objs = []
    for shape in shapes:
        try:
            objs.append(make_objective(problem, shape, objective))
        except ConfigError as exc:
            if len(shapes) == 1:
                raise
            log.debug("shape %s skipped: %s", shape, exc)
    if not objs:
        raise ConfigError("training", "no pipeline shape is valid for this model and roster")
    if len(objs) <= keep:
        return objs
    chains = device_chains(objs[0].pair_cost, max_cuts=1)
    scored: list[tuple[float, float, Shape, Objective]] = []
    for obj in objs:
        if time.monotonic() > deadline and scored:
            break
        s = obj.shape
        best: Cost | None = None
        for chain in chains:
            active = active_devices(obj, s.active)
            sub = chain[np.isin(chain, active)]
            spares = np.setdiff1d(np.arange(problem.n), active)
            for h, w in ((1, s.d_dp), (s.d_pp, 1)):
                ev = obj.evaluate(grid_groups(sub, s.d_pp, s.d_dp, h, w, True, True), spares)
                if best is None or ev.cost.better_than(best):
                    best = ev.cost
        assert best is not None, "device_chains returns at least one chain"
        scored.append((best.total, best.soft, s, obj))
    scored.sort(key=lambda x: (x[0], x[1], x[2]))
    return [x[3] for x in scored[:keep]]
