"""Evolutionary allocation search on deap: one ``Island`` = one population that can exchange migrants.

Hybrid genetic algorithm: individuals are balanced partitions of the devices into
``d_pp`` groups (+ spares); the stage order and replica matching are derived
exactly by the objective. Each generation a (mu + lambda) step breeds children by
tournament selection, a balanced greedy-partition crossover (alternately inherit
the parent group with the most still-free devices, then top up the short groups
with the leftovers), random swap mutation and the swap local search, and keeps
the best distinct individuals. After ``restart_after`` generations without
progress the worse half is replaced by strongly perturbed copies of the best
(iterated local search). Randomness comes only from a seeded numpy Generator, so
an island is deterministic for a seed and a number of generations.

Islands talk in plain data: ``best(k)`` returns ``Allocation``s (device ids),
``accept(migrants)`` takes allocations or plain ``[[id, ...], ...]`` stage lists,
re-scores them locally (claims are never trusted) and drops malformed ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from deap import base, creator, tools

from peerd.errors import ConfigError
from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.layout import from_allocation, to_allocation
from peerd.sched.localsearch import LocalSearch
from peerd.sched.objective import Evaluation, Objective
from peerd.sched.seeding import constructions, random_layout

log = get_logger(__name__)

RANDOM_SEEDS_MAX = 256  # above this many devices a random start costs more local search than it brings


def _share(deadline: float | None, parts: int) -> float | None:
    """Deadline for the next of ``parts`` pieces of work: half of what is left (all of it for the last)."""
    if deadline is None:
        return None
    now = time.monotonic()
    return now + (deadline - now) / (2 if parts > 1 else 1)


if not hasattr(creator, "PeerdFitness"):
    # Lexicographic: seconds per iteration first, then the plateau tie-break.
    creator.create("PeerdFitness", base.Fitness, weights=(-1.0, -1.0))
    creator.create("PeerdIndividual", list, fitness=creator.PeerdFitness, ev=None)


class Individual(Protocol):
    """A ``creator.PeerdIndividual``: deap's list of genes (device indices) plus these."""

    ev: Evaluation
    fitness: Any  # deap's Fitness (deap has no type hints)


@dataclass
class SearchConfig:
    """Knobs of one island; the defaults suit 16-1024 devices."""

    population: int = 12
    """Individuals kept (mu)."""
    offspring: int = 6
    """Children bred per generation (lambda)."""
    crossover_prob: float = 0.8
    tournament: int = 3
    mutation_swaps: float = 1.5
    """Mean number of random swaps applied to a child."""
    candidates: int | None = None
    """Swap partners scored per critical device (None: all; else a random sample of this size)."""
    restart_after: int = 8
    """Generations without improvement before the worse half is re-seeded."""
    constructions: bool = True
    """Seed with the cluster-aware constructions (off: random start only, as in ablations)."""


class Island:
    """One population of the evolutionary search for one objective (one shape)."""

    def __init__(
        self,
        objective: Objective,
        seed: int,
        config: SearchConfig | None = None,
        initial: Sequence[Evaluation | Allocation] = (),
        deadline: float | None = None,
    ) -> None:
        self.obj = objective
        self.cfg = config or SearchConfig()
        self.rng = np.random.default_rng(seed)
        self.local = LocalSearch(objective, candidates=self.cfg.candidates)
        self.generation = 0
        self.stale = 0
        self.history: list[float] = []
        self.logbook = tools.Logbook()
        self.hall = tools.HallOfFame(max(8, self.cfg.population))
        self.toolbox = base.Toolbox()
        self.toolbox.register("select", self._tournament)
        self.toolbox.register("mate", self._crossover)
        self.toolbox.register("mutate", self._mutate)
        self.toolbox.register("improve", self._improve)
        self.population: list[Individual] = []
        self._seed_population(initial, deadline)

    # --- public API ------------------------------------------------------------------------
    def step(self, generations: int = 1, deadline: float | None = None) -> bool:
        """Run up to ``generations`` generations (stopping at ``deadline``); True if the best improved."""
        before = self.best_cost()
        for _ in range(generations):
            if deadline is not None and time.monotonic() > deadline:
                break
            self._generation(deadline)
        return self.best_cost() < before

    def best(self, k: int = 1) -> list[Allocation]:
        """The ``k`` best distinct allocations found so far (plain device ids)."""
        return [to_allocation(self.obj, ind.ev) for ind in self.hall[:k]]

    def best_evaluations(self, k: int = 1) -> list[Evaluation]:
        return [ind.ev for ind in self.hall[:k]]

    def best_cost(self) -> float:
        return self.hall[0].ev.cost.total if len(self.hall) else float("inf")

    def accept(self, migrants: Iterable[Allocation | Sequence[Sequence[str]]]) -> int:
        """Take migrants from other islands into the population; returns how many were usable."""
        taken = 0
        for m in migrants:
            try:
                alloc = (
                    m if isinstance(m, Allocation) else Allocation.from_plain(m, known=self.obj.problem.ids)
                )
                ev = from_allocation(self.obj, alloc)
            except ConfigError as exc:
                log.warning("dropping malformed migrant: %s", exc)
                continue
            ind = self._individual(self.obj.evaluate(ev.groups, ev.spares))
            if any(ind == other for other in self.population):
                continue
            self.population.append(ind)
            self.hall.update([ind])
            taken += 1
        self.population = tools.selBest(self.population, max(self.cfg.population, 1))
        return taken

    # --- internals -------------------------------------------------------------------------
    def _individual(self, ev: Evaluation) -> Individual:
        groups = sorted((np.sort(g) for g in ev.groups), key=lambda g: int(g[0]))
        genes = [int(d) for g in groups for d in g] + [int(d) for d in np.sort(ev.spares)]
        ind = creator.PeerdIndividual(genes)
        ind.ev = ev
        ind.fitness.values = (ev.cost.total, ev.cost.soft)
        return ind

    def _improve(self, ev: Evaluation, deadline: float | None) -> Evaluation:
        return self.local.run(ev, self.rng, deadline=deadline)

    def _seed_population(self, initial: Sequence[Evaluation | Allocation], deadline: float | None) -> None:
        """Initial individuals: given ones, constructions, then random (or, for large clusters,
        perturbed copies of the best so far, which the local search settles quickly)."""
        seeds: list[Evaluation] = []
        for item in initial:
            seeds.append(from_allocation(self.obj, item) if isinstance(item, Allocation) else item)
        if self.cfg.constructions:
            seeds.extend(constructions(self.obj)[: max(1, self.cfg.population // 2)])
        seeds = seeds[: self.cfg.population]
        big = self.obj.problem.n > RANDOM_SEEDS_MAX
        for _attempt in range(
            3 * self.cfg.population
        ):  # duplicates are dropped; tiny problems have few optima
            if len(self.population) >= self.cfg.population:
                break
            if deadline is not None and time.monotonic() > deadline and self.population:
                break
            if seeds:
                ev = seeds.pop(0)
            elif big and self.population:
                best = min(self.population, key=lambda ind: ind.ev.cost).ev
                groups, spares = self._mutate(
                    [g.copy() for g in best.groups], best.spares.copy(), self.obj.shape.d_dp
                )
                ev = self.obj.evaluate(groups, spares)
            else:
                ev = random_layout(self.obj, self.rng)
            left = len(seeds) + self.cfg.population - len(self.population)
            ind = self._individual(self.toolbox.improve(ev, _share(deadline, left)))
            if not any(ind == other for other in self.population):
                self.population.append(ind)
        self.hall.update(self.population)
        self.history.append(self.best_cost())

    def _generation(self, deadline: float | None) -> None:
        cfg = self.cfg
        children = []
        for _ in range(cfg.offspring):
            p1, p2 = self.toolbox.select(self.population, 2)
            if self.rng.random() < cfg.crossover_prob and p1 != p2:
                groups, spares = self.toolbox.mate(p1.ev, p2.ev)
            else:
                groups, spares = [g.copy() for g in p1.ev.groups], p1.ev.spares.copy()
            groups, spares = self.toolbox.mutate(groups, spares, cfg.mutation_swaps)
            ev = self.toolbox.improve(self.obj.evaluate(groups, spares), deadline)
            children.append(self._individual(ev))
            if deadline is not None and time.monotonic() > deadline:
                break
        before = self.best_cost()
        pool: list[Individual] = []
        for ind in self.population + children:
            if not any(ind == other for other in pool):
                pool.append(ind)
        self.population = tools.selBest(pool, cfg.population)
        self.hall.update(self.population)
        self.generation += 1
        self.stale = 0 if self.best_cost() < before - 1e-12 else self.stale + 1
        if self.stale >= cfg.restart_after:
            self._restart(deadline)
            self.stale = 0
        self.history.append(self.best_cost())
        self.logbook.record(gen=self.generation, best=self.best_cost(), evals=self.obj.evaluations)

    def _restart(self, deadline: float | None) -> None:
        """Keep the better half; replace the rest by heavily mutated copies of the best."""
        keep = self.population[: max(1, len(self.population) // 2)]
        best = self.hall[0].ev
        fresh: list[Individual] = []
        for _ in range(len(self.population) - len(keep)):
            groups, spares = self._mutate(
                [g.copy() for g in best.groups], best.spares.copy(), self.obj.shape.d_dp
            )
            ev = self.toolbox.improve(self.obj.evaluate(groups, spares), deadline)
            ind = self._individual(ev)
            if not any(ind == other for other in keep + fresh):
                fresh.append(ind)
        self.population = keep + fresh
        self.hall.update(fresh)

    def _tournament(self, population: list[Individual], k: int) -> list[Individual]:
        out = []
        for _ in range(k):
            idx = self.rng.choice(
                len(population), size=min(self.cfg.tournament, len(population)), replace=False
            )
            out.append(min((population[i] for i in idx), key=lambda ind: ind.ev.cost))
        return out

    def _crossover(self, a: Evaluation, b: Evaluation) -> tuple[list[np.ndarray], np.ndarray]:
        """Balanced greedy partition crossover: inherit whole groups, fill the gaps with leftovers."""
        d_pp, d_dp = self.obj.shape.d_pp, self.obj.shape.d_dp
        parents = [[set(map(int, g)) for g in a.groups], [set(map(int, g)) for g in b.groups]]
        first = int(self.rng.integers(2))
        assigned: set[int] = set()
        child: list[list[int]] = []
        for k in range(d_pp):
            src = parents[(first + k) % 2]
            sizes = np.array([len(g - assigned) for g in src])
            options = np.flatnonzero(sizes == sizes.max())
            take = sorted(src[int(self.rng.choice(options))] - assigned)
            child.append(take)
            assigned.update(take)
        active = set(map(int, np.concatenate(a.groups))) | set(map(int, np.concatenate(b.groups)))
        pool = [d for d in self.rng.permutation(self.obj.problem.n).tolist() if d not in assigned]
        pool.sort(key=lambda d: d not in active)  # stable: devices active in a parent first
        for g in child:
            while len(g) < d_dp:
                g.append(pool.pop(0))
        return [np.sort(np.array(g, dtype=np.intp)) for g in child], np.sort(np.array(pool, dtype=np.intp))

    def _mutate(self, groups: list[np.ndarray], spares: np.ndarray, mean_swaps: float):
        """Random swaps between groups (or with a spare)."""
        n_groups = len(groups)
        for _ in range(1 + int(self.rng.poisson(max(mean_swaps - 1.0, 0.0)))):
            ga = int(self.rng.integers(n_groups))
            choices = n_groups - 1 + (1 if len(spares) else 0)
            if choices == 0:
                break
            gb = int(self.rng.integers(choices))
            gb = gb if gb < ga else gb + 1
            i = int(self.rng.integers(len(groups[ga])))
            if gb >= n_groups:
                j = int(self.rng.integers(len(spares)))
                groups[ga][i], spares[j] = spares[j], groups[ga][i]
            else:
                j = int(self.rng.integers(len(groups[gb])))
                groups[ga][i], groups[gb][j] = groups[gb][j], groups[ga][i]
        return [np.sort(g) for g in groups], np.sort(spares)
