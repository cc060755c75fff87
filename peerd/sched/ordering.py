"""Pipeline ordering: bottleneck matching between stage groups and open-loop TSP over groups.

- ``bottleneck_assignment(C)``: the one-to-one matching of rows to columns that
  minimises the largest matched cost (a bottleneck assignment problem); among
  those, the one with the smallest sum (a tie-break that keeps the other
  pipelines fast too). Binary search over the distinct costs, each step a
  feasibility check by ``linear_sum_assignment`` on the 0/1 "too slow" matrix,
  which for the group sizes here (8-64) is faster than a sparse matching.
- ``open_path(W)``: the cheapest Hamiltonian path (any start, any end) over a
  symmetric or directed weight matrix. Exact by dynamic programming over subsets
  (Held-Karp, vectorised per subset size) for up to ``EXACT_TSP_MAX`` nodes;
  beyond that nearest-neighbour starts improved by 2-opt and Or-opt moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations, pairwise

import numpy as np
from scipy.optimize import linear_sum_assignment

EXACT_TSP_MAX = 16  # Held-Karp: 2^16 * 16^2 steps, ~0.1 s in numpy
SEARCH_TSP_MAX = 10  # inside the search loop, where orders are computed thousands of times
_BIG = 1e30


@dataclass(frozen=True)
class Matching:
    """Result of a bottleneck assignment: column ``perm[i]`` is matched to row ``i``."""

    bottleneck: float
    total: float
    perm: tuple[int, ...]


def bottleneck_assignment(cost: np.ndarray) -> Matching:
    """Min-max perfect matching of a square cost matrix, min-sum among the min-max ones."""
    n = cost.shape[0]
    assert cost.shape == (n, n), cost.shape
    # Every row and every column must use one of its entries: a lower bound that is
    # usually the answer when links are clustered, so test it first.
    lower = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    if not _feasible(cost, lower):
        values = np.unique(cost[cost > lower])
        lo, hi = 0, len(values) - 1  # values[hi] (the max) is always feasible
        while lo < hi:
            mid = (lo + hi) // 2
            if _feasible(cost, values[mid]):
                hi = mid
            else:
                lo = mid + 1
        lower = values[lo]
    rows, cols = linear_sum_assignment(np.where(cost <= lower, cost, _BIG))
    return Matching(float(lower), float(cost[rows, cols].sum()), tuple(int(c) for c in cols))


def _feasible(cost: np.ndarray, threshold: float) -> bool:
    too_slow = (cost > threshold).astype(np.float64)
    rows, cols = linear_sum_assignment(too_slow)
    return not too_slow[rows, cols].any()


def path_cost(weights: np.ndarray, order: list[int] | tuple[int, ...]) -> float:
    """Length of the open path visiting ``order``."""
    return float(sum(weights[a, b] for a, b in pairwise(order)))


def open_path(weights: np.ndarray, exact_max: int = EXACT_TSP_MAX) -> tuple[float, list[int]]:
    """Cheapest open Hamiltonian path: (length, node order). Exact up to ``exact_max`` nodes."""
    n = weights.shape[0]
    if n <= 2:
        return (float(weights[0, 1]) if n == 2 else 0.0), list(range(n))
    if n <= min(exact_max, EXACT_TSP_MAX):
        return _held_karp(np.asarray(weights, dtype=np.float64))
    return _heuristic_path(np.asarray(weights, dtype=np.float64))


@lru_cache(maxsize=32)
def _layers(n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per subset size k >= 2: masks (C,), their members (C, k) and mask-without-member (C, k)."""
    out = []
    for k in range(2, n + 1):
        members = np.array(list(combinations(range(n), k)), dtype=np.intp)  # (C, k)
        masks = (1 << members).sum(axis=1)
        prev = masks[:, None] ^ (1 << members)
        out.append((masks, members, prev))
    return out


def _held_karp(w: np.ndarray) -> tuple[float, list[int]]:
    n = w.shape[0]
    full = (1 << n) - 1
    best = np.full((1 << n, n), np.inf)  # best[mask, t]: cheapest path over mask ending at t
    parent = np.full((1 << n, n), -1, dtype=np.int8)
    best[1 << np.arange(n), np.arange(n)] = 0.0
    wt = w.T  # wt[t, j] = w[j, t]
    for masks, members, prev in _layers(n):
        # cand[c, i, j] = best[prev[c, i], j] + w[j, members[c, i]]
        cand = best[prev] + wt[members]  # (C, k, n)
        arg = cand.argmin(axis=2)
        best[masks[:, None], members] = np.take_along_axis(cand, arg[..., None], axis=2)[..., 0]
        parent[masks[:, None], members] = arg
    end = int(best[full].argmin())
    total = float(best[full, end])
    order, mask = [end], full
    while len(order) < n:
        prev_node = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(prev_node)
    order.reverse()
    return total, order


def _heuristic_path(w: np.ndarray) -> tuple[float, list[int]]:
    n = w.shape[0]
    best_cost, best_order = np.inf, list(range(n))
    for start in range(n):
        order, left = [start], set(range(n)) - {start}
        while left:
            row = w[order[-1]]
            nxt = min((row[j], j) for j in left)[1]  # nearest, ties to the lowest index
            order.append(nxt)
            left.remove(nxt)
        cost = path_cost(w, order)
        if cost < best_cost - 1e-12:
            best_cost, best_order = cost, order
    return _improve_path(w, best_order)


def _improve_path(w: np.ndarray, order: list[int]) -> tuple[float, list[int]]:
    """2-opt (segment reversal, prefix/suffix included) and Or-opt (move 1-3 nodes) until no gain.

    Deltas are O(1) per candidate, which assumes a symmetric ``w`` (both cost models symmetrise).
    """
    n = len(order)

    def e(a: int | None, b: int | None) -> float:
        return 0.0 if a is None or b is None else float(w[a, b])

    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            for j in range(i + 1, n):
                if i == 0 and j == n - 1:
                    continue
                before = order[i - 1] if i > 0 else None
                after = order[j + 1] if j < n - 1 else None
                delta = e(before, order[j]) + e(order[i], after) - e(before, order[i]) - e(order[j], after)
                if delta < -1e-12:
                    order = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                    improved = True
        for seg in (1, 2, 3):
            i = 0
            while i + seg <= n:
                piece, rest = order[i : i + seg], order[:i] + order[i + seg :]
                before = order[i - 1] if i > 0 else None
                after = order[i + seg] if i + seg < n else None
                gain = e(before, piece[0]) + e(piece[-1], after) - e(before, after)
                best_delta, best_cand = -1e-12, None
                for k in range(len(rest) + 1):
                    if k == i:
                        continue
                    x = rest[k - 1] if k > 0 else None
                    y = rest[k] if k < len(rest) else None
                    for p in (piece, piece[::-1]) if seg > 1 else (piece,):
                        delta = e(x, p[0]) + e(p[-1], y) - e(x, y) - gain
                        if delta < best_delta:
                            best_delta, best_cand = delta, rest[:k] + p + rest[k:]
                if best_cand is not None:
                    order, improved = best_cand, True
                i += 1
    return path_cost(w, order), order
