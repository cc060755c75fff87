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
from peerd.sched.objective import Cost, Edge, Objective
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
        for i, e in enumerate(edges):
            a, b = groups[i].members, groups[i + 1].members
            for pos in e.worst:
                out.extend((int(a[pos]), int(b[e.perm[pos]])))
        return list(dict.fromkeys(out))

    # --- vectorised grid moves ------------------------------------------------------------
    def swap_scores(
        self, grid: np.ndarray, spares: np.ndarray, upos: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(total, soft) after swapping cell ``upos[p]`` with cell ``cand[p]`` (different rows), all p at once."""
        n_pp, n_dp = grid.shape
        dpp, pc = self.dp_pair, self.pair_cost
        p_idx = np.arange(len(upos))
        rk, ck = np.divmod(upos, n_dp)  # (P,) u's row and column
        rl, cl = np.divmod(cand, n_dp)  # (P,) v's row and column
        u, v = grid[rk, ck], grid[rl, cl]
        # Data-parallel sums S[r, c] = sum over the row of dp_pair[grid[r, c], .]
        sums = dpp[grid[:, :, None], grid[:, None, :]].sum(axis=2)  # (G, D)
        dp_rows = sums.max(axis=1)  # (G,)

        def row_after(r, c, out_dev, in_dev):
            """Row r with out_dev (at column c) replaced by in_dev: its new max DP sum, (P,)."""
            members = grid[r]  # (P, D)
            new = sums[r] - dpp[members, out_dev[:, None]] + dpp[members, in_dev[:, None]]
            new[p_idx, c] = dpp[in_dev[:, None], members].sum(axis=1) - dpp[in_dev, out_dev]
            return new.max(axis=1)

        dp_k, dp_l = row_after(rk, ck, u, v), row_after(rl, cl, v, u)
        # Largest untouched row: walk the three largest rows, skipping rows k and l.
        order = np.argsort(-dp_rows, kind="stable")[:3]
        rest = np.full(len(upos), -np.inf)
        for r in order[::-1]:
            rest = np.where((rk != r) & (rl != r), dp_rows[r], rest)
        dp_new = np.maximum(rest, np.maximum(dp_k, dp_l))
        soft_dp = (dp_rows.sum() - dp_rows[rk] - dp_rows[rl] + dp_k + dp_l) / n_pp
        if n_pp == 1:
            return dp_new, soft_dp
        # Pipeline edges: only the (at most four) edges touching row k or row l change.
        pmat = pc[grid[:-1], grid[1:]]  # (G-1, D)
        e_max, e_mean = pmat.max(axis=1), pmat.mean(axis=1)

        def edge_delta(top_row):
            valid = (top_row >= 0) & (top_row <= n_pp - 2)
            t = np.clip(top_row, 0, n_pp - 2)
            top, bottom = grid[t], grid[t + 1]  # (P, D) copies (fancy indexing)
            for arr, r in ((top, t), (bottom, t + 1)):
                hit = r == rk
                arr[p_idx[hit], ck[hit]] = v[hit]
                hit = r == rl
                arr[p_idx[hit], cl[hit]] = u[hit]
            pcs = pc[top, bottom]
            return (
                np.where(valid, pcs.max(axis=1) - e_max[t], 0.0),
                np.where(valid, pcs.sum(axis=1) / n_dp - e_mean[t], 0.0),
            )

        d_max, d_mean = np.zeros(len(upos)), np.zeros(len(upos))
        for top_row, dedupe in ((rk - 1, False), (rk, False), (rl - 1, True), (rl, True)):
            dm, dn = edge_delta(top_row)
            if dedupe:  # an edge next to row l that also touches row k is counted already
                fresh = (top_row != rk - 1) & (top_row != rk)
                dm, dn = np.where(fresh, dm, 0.0), np.where(fresh, dn, 0.0)
            d_max += dm
            d_mean += dn
        return dp_new + e_max.sum() + d_max, soft_dp + e_mean.sum() + d_mean

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
