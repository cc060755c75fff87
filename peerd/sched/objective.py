"""What every cost model shares: cached per-group and per-group-pair quantities, and full evaluation.

A cost model (``Objective``) scores a *layout*: ``d_pp`` groups of ``d_dp`` devices
(plus spare devices), an order of the groups into a pipeline, and the device
matching between consecutive groups. It is built from two cached primitives:

- ``group(members)``: everything about one stage group that does not depend on
  its neighbours (data-parallel cost, slowest device, smallest memory);
- ``edge(a, b)``: the bottleneck matching between two groups on the model's
  per-pair transfer cost (``pair_cost``, symmetric), see ``ordering.py``;

and one assembly step, ``combine``, which turns the groups (in pipeline order)
and the edges along the path into ``Cost`` (total seconds, a tie-break, and a
breakdown). Caches are keyed by the sorted member indices, so the many layouts a
search visits share their work. ``evaluate`` picks the order by open-loop TSP
over the edge bottlenecks.

The local search works on *grids* instead ((d_pp, d_dp) device indices: stage
order and replica pairing fixed as laid out): ``grid_cost`` scores one,
``swap_scores`` scores many cell swaps at once (models vectorise it), and
``grid_critical`` names the cells worth moving.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from peerd.sched.ordering import EXACT_TSP_MAX, SEARCH_TSP_MAX, bottleneck_assignment, open_path
from peerd.sched.problem import Problem, Shape

_CACHE_LIMIT = 400_000


@dataclass(frozen=True)
class Edge:
    """Bottleneck matching between group ``a`` and group ``b`` (members in sorted order)."""

    value: float
    """Largest matched pair cost (what the pipeline waits for)."""
    mean: float
    """Mean matched pair cost (tie-break: how good the other pipelines are)."""
    perm: tuple[int, ...]
    """``a.members[i]`` sends to ``b.members[perm[i]]``."""
    worst: tuple[int, ...]
    """Positions i in ``a`` whose matched pair costs ``value`` (the devices to fix)."""


def edge_culprits(members: list[np.ndarray], edges: list[Edge]) -> list[int]:
    """The devices at both ends of every edge's worst matched pairs (``members[i]`` feeds edge ``i``)."""
    out: list[int] = []
    for i, e in enumerate(edges):
        a, b = members[i], members[i + 1]
        for pos in e.worst:
            out.extend((int(a[pos]), int(b[e.perm[pos]])))
    return out


@dataclass(frozen=True, order=True)
class Cost:
    """Lexicographic score: ``total`` seconds per iteration, then ``soft`` to leave plateaus."""

    total: float
    soft: float
    parts: dict[str, float] = field(default_factory=dict, compare=False)

    def better_than(self, other: Cost, eps: float = 1e-9) -> bool:
        if self.total < other.total - eps * max(1.0, abs(other.total)):
            return True
        close = abs(self.total - other.total) <= eps * max(1.0, abs(other.total))
        return close and self.soft < other.soft - eps * max(1.0, abs(other.soft))


@dataclass
class Evaluation:
    """A fully specified layout and its cost; ``groups[order[k]]`` is stage k."""

    groups: list[np.ndarray]
    spares: np.ndarray
    order: list[int]
    cost: Cost


class Objective(ABC):
    """A cost model over layouts of one ``Problem`` with a fixed ``Shape``."""

    name: ClassVar[str]
    orientation_matters: ClassVar[bool] = False

    def __init__(self, problem: Problem, shape: Shape) -> None:
        self.problem = problem
        self.shape = shape
        self.pair_cost = self._pair_cost()  # (N, N), symmetric, zero diagonal
        self.affinity = self.pair_cost  # (N, N): what a device adds to a group (models refine it)
        self.speed = problem.tflops  # (N,): how fast a device computes a layer (models refine it)
        self._groups: dict[bytes, Any] = {}
        self._edges: dict[tuple[bytes, bytes], Edge] = {}
        self.evaluations = 0

    # --- model-specific pieces ------------------------------------------------------------
    @abstractmethod
    def _pair_cost(self) -> np.ndarray:
        """Per device pair cost of one stage-boundary transfer (forward + backward), symmetric."""

    @abstractmethod
    def _group(self, members: np.ndarray) -> Any:
        """Per-group quantities (``members`` sorted)."""

    @abstractmethod
    def combine(self, groups: list[Any], edges: list[Edge], spares: np.ndarray) -> Cost:
        """Cost of the pipeline with ``groups`` in stage order and ``edges`` between consecutive ones."""

    @abstractmethod
    def critical(self, groups: list[Any], edges: list[Edge]) -> list[int]:
        """Device indices whose move could lower the total (the local search starts there)."""

    def layer_split(self, groups: list[Any], edges: list[Edge]) -> tuple[int, ...] | None:
        """Layers per stage for groups in stage order; None = the even split the model assumes."""
        return None

    # --- grid level: the local search's view --------------------------------------------
    # A grid is (d_pp, d_dp) device indices: row k = stage k in order, column j = replica j.
    # Positions: cell k * d_dp + j, then spare s at d_pp * d_dp + s.
    def column_edge(self, top: np.ndarray, bottom: np.ndarray) -> Edge:
        """Edge between two grid rows with the pairing as laid out (top[j] -> bottom[j])."""
        matched = self.pair_cost[top, bottom]
        value = float(matched.max())
        st, sb = np.argsort(top), np.argsort(bottom)
        pos_b = np.empty(len(bottom), dtype=np.intp)
        pos_b[sb] = np.arange(len(bottom))
        perm = tuple(int(pos_b[j]) for j in st)
        worst = tuple(i for i, j in enumerate(st) if matched[j] >= value - 1e-12)
        return Edge(value, float(matched.mean()), perm, worst)

    def grid_cost(self, grid: np.ndarray, spares: np.ndarray) -> Cost:
        """Cost of a grid exactly as laid out (its order and its pairing)."""
        self.evaluations += 1
        edges = [self.column_edge(grid[k], grid[k + 1]) for k in range(len(grid) - 1)]
        return self.combine([self.group(row) for row in grid], edges, spares)

    def grid_critical(self, grid: np.ndarray, spares: np.ndarray) -> list[int]:
        """Positions whose device could lower the total when moved."""
        where = {int(d): k * grid.shape[1] + j for (k, j), d in np.ndenumerate(grid)}
        edges = [self.column_edge(grid[k], grid[k + 1]) for k in range(len(grid) - 1)]
        return [where[d] for d in self.critical([self.group(row) for row in grid], edges) if d in where]

    def swap_scores(
        self, grid: np.ndarray, spares: np.ndarray, upos: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(total, soft) of the grid after swapping position ``upos[p]`` with ``cand[p]``, for every p.

        Generic version: re-score the whole grid per pair. Objectives override it with a
        vectorised one where their cost allows.
        """
        flat = np.concatenate([grid.ravel(), spares])
        totals, softs = np.empty(len(cand)), np.empty(len(cand))
        for i, (a, b) in enumerate(zip(upos, cand, strict=True)):
            f = flat.copy()
            f[a], f[b] = f[b], f[a]
            c = self.grid_cost(f[: grid.size].reshape(grid.shape), f[grid.size :])
            totals[i], softs[i] = c.total, c.soft
        return totals, softs

    # --- cached primitives ----------------------------------------------------------------
    @staticmethod
    def key(members: np.ndarray) -> bytes:
        return np.sort(members).astype(np.int32).tobytes()

    def group(self, members: np.ndarray) -> Any:
        k = self.key(members)
        info = self._groups.get(k)
        if info is None:
            if len(self._groups) > _CACHE_LIMIT:
                self._groups.clear()
            info = self._groups[k] = self._group(np.sort(members))
        return info

    def edge(self, a: np.ndarray, b: np.ndarray) -> Edge:
        """Matching from group ``a`` to group ``b`` (positions refer to their sorted members)."""
        ka, kb = self.key(a), self.key(b)
        flip = kb < ka
        k = (kb, ka) if flip else (ka, kb)
        e = self._edges.get(k)
        if e is None:
            if len(self._edges) > _CACHE_LIMIT:
                self._edges.clear()
            sa, sb = (np.sort(b), np.sort(a)) if flip else (np.sort(a), np.sort(b))
            m = bottleneck_assignment(self.pair_cost[np.ix_(sa, sb)])
            matched = self.pair_cost[sa, sb[list(m.perm)]]
            worst = tuple(int(i) for i in np.flatnonzero(matched >= m.bottleneck - 1e-12))
            e = self._edges[k] = Edge(m.bottleneck, m.total / len(sa), m.perm, worst)
        if flip:
            inv = [0] * len(e.perm)
            for i, p in enumerate(e.perm):
                inv[p] = i
            e = Edge(e.value, e.mean, tuple(inv), tuple(sorted(e.perm[i] for i in e.worst)))
        return e

    # --- whole layouts --------------------------------------------------------------------
    def path_edges(self, groups: list[np.ndarray], order: list[int]) -> list[Edge]:
        return [self.edge(groups[a], groups[b]) for a, b in itertools.pairwise(order)]

    def cost_in_order(self, groups: list[np.ndarray], order: list[int], spares: np.ndarray) -> Cost:
        self.evaluations += 1
        return self.combine([self.group(groups[g]) for g in order], self.path_edges(groups, order), spares)

    def best_order(self, groups: list[np.ndarray], exact: bool = False) -> list[int]:
        """Stage order: open-loop TSP over the edge bottlenecks.

        Exact (Held-Karp) up to 10 groups, or up to 16 with ``exact`` (final answers);
        2-opt/Or-opt from nearest-neighbour starts beyond.
        """
        g = len(groups)
        w = np.zeros((g, g))
        for i in range(g):
            for j in range(i + 1, g):
                w[i, j] = w[j, i] = self.edge(groups[i], groups[j]).value
        return open_path(w, EXACT_TSP_MAX if exact else SEARCH_TSP_MAX)[1]

    def evaluate(
        self,
        groups: list[np.ndarray],
        spares: np.ndarray,
        order: list[int] | None = None,
        exact: bool = False,
    ) -> Evaluation:
        """Cost of a partition with the best order found (or the given ``order``)."""
        groups = [np.sort(np.asarray(m)) for m in groups]
        if order is None:
            order = self.best_order(groups, exact)
            if self.orientation_matters and len(order) > 1:
                rev = order[::-1]
                if self.cost_in_order(groups, rev, spares).better_than(
                    self.cost_in_order(groups, order, spares)
                ):
                    order = rev
        return Evaluation(
            groups,
            np.sort(np.asarray(spares, dtype=np.intp)),
            order,
            self.cost_in_order(groups, order, spares),
        )
