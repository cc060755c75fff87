"""Local search on the (stage x replica) grid: swaps driven by exact cost gains, then exact re-matching.

The grid fixes the stage order and the replica pairing, so swapping two cells
(or a cell and a spare) only touches two rows and at most four edges; the
objective scores *all* swaps of one device at once (vectorised for ``dtfm``).
Moves start from the critical devices (those that set the data-parallel max or
sit in a bottleneck pair); acceptance is lexicographic on (total, soft), which
walks the plateaus of max-based costs. When no swap helps, the groups are
re-evaluated exactly (bottleneck matchings + TSP order); if that is better the
search continues from the re-laid grid, else it stops. Grid cost >= exact cost
of the same groups in the same order, so the re-matching never loses.
"""

from __future__ import annotations

import time

import numpy as np

from peerd.sched.objective import Cost, Evaluation, Objective


def grid_of(obj: Objective, ev: Evaluation) -> tuple[np.ndarray, np.ndarray]:
    """Lay an evaluation onto a grid: rows in stage order, columns following its matchings."""
    rows = [ev.groups[g] for g in ev.order]
    edges = obj.path_edges(ev.groups, ev.order)
    cols = np.arange(len(rows[0]))
    grid = np.empty((len(rows), len(rows[0])), dtype=np.intp)
    grid[0] = rows[0]
    for k, e in enumerate(edges):
        cols = np.asarray(e.perm, dtype=np.intp)[cols]
        grid[k + 1] = rows[k + 1][cols]
    return grid, ev.spares.copy()


def _improving(totals: np.ndarray, softs: np.ndarray, cost: Cost, eps: float = 1e-9) -> int | None:
    tol_t = eps * max(1.0, abs(cost.total))
    tol_s = eps * max(1.0, abs(cost.soft))
    ok = (totals < cost.total - tol_t) | (
        (np.abs(totals - cost.total) <= tol_t) & (softs < cost.soft - tol_s)
    )
    if not ok.any():
        return None
    idx = np.flatnonzero(ok)
    return int(idx[np.lexsort((softs[idx], totals[idx]))[0]])


class LocalSearch:
    """Swap descent + exact re-matching for one objective (shares the objective's caches)."""

    def __init__(self, objective: Objective, candidates: int | None = None, chunk: int = 4096) -> None:
        self.obj = objective
        self.candidates = candidates  # None: every position; else a random sample of this many
        self.chunk = chunk  # swap pairs scored per vectorised call
        self.moves = 0

    def run(
        self,
        ev: Evaluation,
        rng: np.random.Generator,
        *,
        deadline: float | None = None,
        max_rounds: int = 1_000,
    ) -> Evaluation:
        for _ in range(max_rounds):
            grid, spares = grid_of(self.obj, ev)
            moved = self._descend(grid, spares, self.obj.grid_cost(grid, spares), rng, deadline)
            if not moved:
                return ev
            relaid = self.obj.evaluate(list(grid), spares)
            kept = self.obj.evaluate(list(grid), spares, order=list(range(len(grid))))
            if kept.cost.better_than(relaid.cost):
                relaid = kept  # a heuristic TSP (many groups) may miss the order we already had
            if not relaid.cost.better_than(ev.cost):
                return ev  # cannot happen for an exact re-match unless the descent only moved ties
            ev = relaid
            if deadline is not None and time.monotonic() > deadline:
                break
        return ev

    def _descend(self, grid: np.ndarray, spares: np.ndarray, cost: Cost, rng, deadline) -> bool:
        """Apply improving swaps in place until none is left; True if anything moved."""
        d_dp, cells = grid.shape[1], grid.size
        total = cells + len(spares)
        moved = False
        while True:
            crit = np.array(self.obj.grid_critical(grid, spares), dtype=np.intp)
            rng.shuffle(crit)
            step = None
            ups: list[np.ndarray] = []
            cands: list[np.ndarray] = []
            pending = 0
            for i, upos in enumerate(crit):
                cand = np.arange(total)
                if upos < cells:
                    cand = cand[(cand // d_dp != upos // d_dp) | (cand >= cells)]
                else:
                    cand = cand[cand < cells]
                if self.candidates is not None and len(cand) > self.candidates:
                    cand = rng.choice(cand, size=self.candidates, replace=False)
                ups.append(np.full(len(cand), upos))
                cands.append(cand)
                pending += len(cand)
                if pending < self.chunk and i < len(crit) - 1:
                    continue
                # First improving chunk wins: cheap when improvements abound, a full scan at the end.
                upos_all, cand_all = np.concatenate(ups), np.concatenate(cands)
                ups, cands, pending = [], [], 0
                if len(upos_all) == 0:
                    continue
                totals, softs = self.obj.swap_scores(grid, spares, upos_all, cand_all)
                best = _improving(totals, softs, cost)
                if best is not None:
                    step = (int(upos_all[best]), int(cand_all[best]))
                    break
                if deadline is not None and time.monotonic() > deadline:
                    return moved
            if step is None:
                return moved
            self._swap(grid, spares, *step)
            cost = self.obj.grid_cost(grid, spares)
            self.moves += 1
            moved = True
            if deadline is not None and time.monotonic() > deadline:
                return moved

    @staticmethod
    def _swap(grid: np.ndarray, spares: np.ndarray, p: int, q: int) -> None:
        flat = grid.reshape(-1)  # a view: writes go to grid
        cells = flat.size

        def get(x: int) -> int:
            return int(flat[x]) if x < cells else int(spares[x - cells])

        def put(x: int, d: int) -> None:
            if x < cells:
                flat[x] = d
            else:
                spares[x - cells] = d

        a, b = get(p), get(q)
        put(p, b)
        put(q, a)
