"""The ``dtfm`` cost model: DT-FM's communication yardstick, exactly as in design/scheduler.md.

With delay ``α[d, d']`` (s), bandwidth ``β[d, d']`` (bit/s), ``c_dp`` the gradient
bytes of one stage and ``c_pp`` the activation bytes one tasklet sends across a
stage boundary per iteration::

    dp(P) = max_{d in P} sum_{d' in P, d' != d} 2 (α[d,d'] + 8 c_dp / (D_DP β[d,d']))
    DP    = max over groups dp(P)
    w(P,Q)= min over matchings of max over matched pairs (α + 8 c_pp / β)
    PP    = min over group orders of sum of w along the path (open-loop TSP)
    total = DP + 2 PP

Links may be asymmetric; the pipeline term then uses ``(α + 8 c_pp / β)`` forward
plus the same backward for each pair (so the pair cost is ``t[d,d'] + t[d',d]``
and ``2 PP`` is that path sum), which is identical to the formula above for
symmetric links. ``parts['pp']`` reports ``PP`` (one direction) like the reference.
Compute, memory and compression are ignored here (that is the ``peerd`` model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peerd.errors import ConfigError
from peerd.sched.objective import Cost, Edge, Objective, edge_culprits
from peerd.sched.problem import Problem, Shape


@dataclass(frozen=True)
class DtfmGroup:
    members: np.ndarray
    dp: float
    rows: np.ndarray  # per-member DP sum, same order as members


def dtfm_sizes(problem: Problem, shape: Shape) -> tuple[float, float]:
    """(c_dp, c_pp) in bytes: explicit training values, else derived from the model."""
    sc = problem.scenario
    tr = sc.training
    if tr is None:
        raise ConfigError("training", "is required by the dtfm objective")
    c_dp, c_pp = tr.c_dp_bytes, tr.c_pp_bytes
    if c_dp is None or c_pp is None:
        if sc.model is None:
            missing = "c_dp_bytes" if c_dp is None else "c_pp_bytes"
            raise ConfigError(f"training.{missing}", "is needed when the scenario has no model section")
        if c_dp is None:
            c_dp = float(sc.model.per_layer_params().sum()) / shape.d_pp * tr.gradient_bytes
        if c_pp is None:
            c_pp = tr.global_batch / shape.d_dp * sc.model.seq * sc.model.hidden * tr.activation_bytes
    return float(c_dp), float(c_pp)


class DtfmObjective(Objective):
    """DT-FM communication cost (seconds per iteration); every device holds a tasklet."""

    name = "dtfm"

    def __init__(self, problem: Problem, shape: Shape) -> None:
        if shape.active != problem.n:
            raise ConfigError(
                "training", f"the dtfm objective uses every device: {shape} != {problem.n} devices"
            )
        self.c_dp, self.c_pp = dtfm_sizes(problem, shape)
        dp_pair = 2.0 * (problem.delay + 8.0 * self.c_dp / (shape.d_dp * problem.bandwidth))
        np.fill_diagonal(dp_pair, 0.0)
        self.dp_pair = dp_pair
        super().__init__(problem, shape)
        self.affinity = dp_pair  # what a device adds to a group's data-parallel cost
        self.dp_pair_t = np.ascontiguousarray(dp_pair.T)  # column gathers as contiguous rows

    def _pair_cost(self) -> np.ndarray:
        t = self.problem.transfer_seconds(self.c_pp)
        return t + t.T

    def _group(self, members: np.ndarray) -> DtfmGroup:
        rows = self.dp_pair[np.ix_(members, members)].sum(axis=1)
        return DtfmGroup(members, float(rows.max()), rows)

    def combine(self, groups: list[DtfmGroup], edges: list[Edge], spares: np.ndarray) -> Cost:
        dp = max(g.dp for g in groups)
        pp2 = sum(e.value for e in edges)
        soft = sum(g.dp for g in groups) / len(groups) + sum(e.mean for e in edges)
        return Cost(dp + pp2, soft, {"dp": dp, "pp": pp2 / 2.0})

    def critical(self, groups: list[DtfmGroup], edges: list[Edge]) -> list[int]:
        dp = max(g.dp for g in groups)
        out: list[int] = []
        for g in groups:
            if g.dp >= dp - 1e-12:
                out.extend(int(d) for d in g.members[g.rows >= g.dp - 1e-12])
        out += edge_culprits([g.members for g in groups], edges)
        return list(dict.fromkeys(out))

    # --- vectorised grid moves ------------------------------------------------------------
    def swap_scores(
        self, grid: np.ndarray, spares: np.ndarray, upos: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(total, soft) after swapping cell ``upos[p]`` with cell ``cand[p]`` (different rows), all p at once.

        Work per distinct ``u`` is O(N * D) gathers into small per-u tables; per pair it
        is O(D) from those tables, so one call scores thousands of swaps.
        """
        n_pp, n_dp = grid.shape
        if len(upos) == 0:
            return np.zeros(0), np.zeros(0)
        dpp, pc = self.dp_pair, self.pair_cost
        flat = grid.ravel()
        p_idx = np.arange(len(upos))
        uniq, ui = np.unique(upos, return_inverse=True)  # distinct u positions, pair -> u index
        rk, ck = np.divmod(upos, n_dp)  # (P,) u's row and column
        rl, cl = np.divmod(cand, n_dp)  # (P,) v's row and column
        u, v = flat[upos], flat[cand]
        uk = uniq // n_dp
        udev = flat[uniq]  # (U,)
        within = dpp[grid[:, :, None], grid[:, None, :]]  # (G, D, D) dp terms inside each row
        sums = within.sum(axis=2)  # (G, D)
        dp_rows = sums.max(axis=1)  # (G,)
        # Per-u tables (U = distinct u).
        # Row slices of dp_pair are contiguous: gather whole rows/columns, then reorder by position.
        to_all = np.stack([dpp[grid[k]][:, flat] for k in uk])  # (U, D, N): row k member -> any device
        all_to = np.stack(
            [self.dp_pair_t[grid[k]].sum(axis=0)[flat] for k in uk]
        )  # (U, N): any device's sum over row k
        to_u = dpp[grid[None, :, :], udev[:, None, None]]  # (U, G, D): every member -> u
        u_sum = dpp[udev[:, None, None], grid[None, :, :]].sum(axis=2)  # (U, G): u's sum over each row
        u_to = dpp[udev[:, None], flat[None, :]]  # (U, N)
        to_u_flat = to_u.reshape(len(uniq), -1)  # (U, N): any device -> u
        # Row k with u -> v, row l with v -> u: every other member swaps one term.
        new_k = sums[rk] - within[rk, :, ck] + to_all[ui, :, cand]
        new_k[p_idx, ck] = all_to[ui, cand] - to_u_flat[ui, cand]
        new_l = sums[rl] - within[rl, :, cl] + to_u[ui, rl]
        new_l[p_idx, cl] = u_sum[ui, rl] - u_to[ui, cand]
        dp_k, dp_l = new_k.max(axis=1), new_l.max(axis=1)
        # Largest untouched row: walk the three largest rows, skipping rows k and l.
        rest = np.full(len(upos), -np.inf)
        for r in np.argsort(-dp_rows, kind="stable")[:3][::-1]:
            rest = np.where((rk != r) & (rl != r), dp_rows[r], rest)
        dp_new = np.maximum(rest, np.maximum(dp_k, dp_l))
        soft_dp = (dp_rows.sum() - dp_rows[rk] - dp_rows[rl] + dp_k + dp_l) / n_pp
        if n_pp == 1:
            return dp_new, soft_dp
        # Pipeline edges: at most four edges change, each in at most two columns.
        pmat = pc[grid[:-1], grid[1:]]  # (G-1, D)
        e_max, e_sum = pmat.max(axis=1), pmat.sum(axis=1)
        k3 = min(3, n_dp)
        top_cols = np.argsort(-pmat, axis=1, kind="stable")[:, :k3]  # (G-1, k3)
        top_vals = np.take_along_axis(pmat, top_cols, axis=1)

        def after(r, c):
            """Device in cell (r, c) after the swap."""
            return np.where((r == rk) & (c == ck), v, np.where((r == rl) & (c == cl), u, grid[r, c]))

        def edge_delta(t):
            valid = (t >= 0) & (t <= n_pp - 2)
            t = np.clip(t, 0, n_pp - 2)
            hit_u = (t == rk) | (t == rk - 1)
            hit_v = ((t == rl) | (t == rl - 1)) & ~(hit_u & (cl == ck))  # same column counted once
            new_u = pc[after(t, ck), after(t + 1, ck)]
            new_v = pc[after(t, cl), after(t + 1, cl)]
            rest = np.full(len(t), -np.inf)
            for i in range(k3 - 1, -1, -1):  # best top entry whose column did not change
                col = top_cols[t, i]
                free = ~((hit_u & (col == ck)) | (hit_v & (col == cl)))
                rest = np.where(free, top_vals[t, i], rest)
            if k3 < 3:  # small groups: fall back to the full column set
                rest = np.where(hit_u | hit_v, _rest_small(pmat, t, ck, cl, hit_u, hit_v), rest)
            new_max = np.maximum(
                rest, np.maximum(np.where(hit_u, new_u, -np.inf), np.where(hit_v, new_v, -np.inf))
            )
            new_sum = (
                e_sum[t]
                + np.where(hit_u, new_u - pmat[t, ck], 0.0)
                + np.where(hit_v, new_v - pmat[t, cl], 0.0)
            )
            return np.where(valid, new_max - e_max[t], 0.0), np.where(valid, (new_sum - e_sum[t]) / n_dp, 0.0)

        d_max, d_mean = np.zeros(len(upos)), np.zeros(len(upos))
        for t, dedupe in ((rk - 1, False), (rk, False), (rl - 1, True), (rl, True)):
            dm, dn = edge_delta(t)
            if dedupe:  # an edge next to row l that also touches row k is counted already
                fresh = (t != rk - 1) & (t != rk)
                dm, dn = np.where(fresh, dm, 0.0), np.where(fresh, dn, 0.0)
            d_max += dm
            d_mean += dn
        return dp_new + e_max.sum() + d_max, soft_dp + e_sum.sum() / n_dp + d_mean

    def grid_critical(self, grid: np.ndarray, spares: np.ndarray) -> list[int]:
        n_pp, n_dp = grid.shape
        sums = self.dp_pair[grid[:, :, None], grid[:, None, :]].sum(axis=2)
        dp_rows = sums.max(axis=1)
        top = dp_rows.max()
        cells = np.argwhere((dp_rows[:, None] >= top - 1e-12) & (sums >= dp_rows[:, None] - 1e-12))
        out = [int(r * n_dp + c) for r, c in cells]
        if n_pp > 1:
            pmat = self.pair_cost[grid[:-1], grid[1:]]
            for e, c in np.argwhere(pmat >= pmat.max(axis=1, keepdims=True) - 1e-12):
                out.extend((int(e * n_dp + c), int((e + 1) * n_dp + c)))
        return list(dict.fromkeys(out))


def _rest_small(pmat: np.ndarray, t, ck, cl, hit_u, hit_v) -> np.ndarray:
    """Max of an edge's unchanged columns when groups have fewer than 3 replicas."""
    cols = np.arange(pmat.shape[1])
    changed = (hit_u[:, None] & (cols[None, :] == ck[:, None])) | (
        hit_v[:, None] & (cols[None, :] == cl[:, None])
    )
    return np.where(changed, -np.inf, pmat[t]).max(axis=1)
