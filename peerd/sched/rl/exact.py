"""Exact scheduler: per task grouping, a MILP over enumerated columns (group, devices per class), HiGHS.

A column is one group holding ``c_k`` devices of each class k, with its predicted task seconds
(best layouts, ``peerd.sched.rl.group``); infeasible columns are dropped. For each grouping:

- binaries ``x_{g,c}``: group g takes column c; ``Σ_c x_{g,c} = 1`` (each task covered once);
- ``Σ_g Σ_c c_k x_{g,c} ≤ |class k|`` (each device used at most once; devices may stay idle);
- presence ``y_{g,k} ≤ Σ_{c: c_k ≥ 1} x_{g,c}``; for each transfer e between groups A and B a
  convex choice ``z_{e,k,l} ≤ y_{A,k}, y_{B,l}``, ``Σ z = 1`` and ``R_e ≥ Σ z_{e,k,l} t_{kl}(bytes_e)``
  (the best present pair, as ``cost.transfer_time``); the sync ``S ≥ R_sync``, ``S ≥ Σ_c x_{gen,c} s_c``;
- each timing path p: ``Σ_{t∈p} Σ_c x_{g(t),c} d_c(t) + Σ_{e∈p} R_e (+ S) ≤ T`` (k = 0), or for
  cycle paths ``≤ (k+1) T`` plus ``T ≥ Σ_c x_{g,c} busy_c`` per group (k ≥ 1);
- minimise T.

This is the evaluator's iteration time exactly, so the optimum over all groupings is the optimum
of the model (tasklet arrangement canonical, see ``layout``). HiGHS reports each MILP's dual
bound; the gap reported is (best - min over groupings of bound) / best.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import lil_matrix

from peerd.errors import ConfigError
from peerd.log import get_logger
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping, Score

log = get_logger(__name__)


@dataclass
class ExactConfig:
    max_groups: int = 3
    max_columns: int = 200_000
    """Refuse instances with more candidate columns than this (use the hybrid search)."""
    time_limit: float = 600.0
    """Seconds HiGHS may spend on one grouping's MILP."""


@dataclass(frozen=True)
class ExactResult:
    grouping: Grouping
    counts: tuple[Counts, ...]
    score: Score
    lower_bound: float
    gap: float
    """(best - proven lower bound) / best over all groupings; 0 = proven optimal."""
    columns: int
    groupings: int
    seconds: float
    evaluations: int


def count_vectors(sizes: np.ndarray) -> list[Counts]:
    """Every non-empty vector 0 <= c_k <= sizes[k]."""
    ranges = [range(int(s) + 1) for s in sizes]
    return [c for c in itertools.product(*ranges) if any(c)]


def solve(ev: Evaluator, cfg: ExactConfig) -> ExactResult:
    start = time.perf_counter()
    if ev.workload.weight_sync != "relay":
        # the star's time couples the trainers' class with every generator count: not linear here
        raise ConfigError(
            "workload.weight_sync",
            f"the exact mode models the relay weight sync only, got {ev.workload.weight_sync!r}; "
            "use the hybrid mode",
        )
    groupings = ev.workflow.groupings(cfg.max_groups)
    task_sets = sorted({g for grouping in groupings for g in grouping})
    n_vectors = math.prod(int(s) + 1 for s in ev.cluster.class_sizes) - 1
    if n_vectors * len(task_sets) > cfg.max_columns:
        raise ConfigError(
            "mode",
            f"exact needs {n_vectors * len(task_sets)} candidate columns here (limit {cfg.max_columns}); "
            "use the hybrid mode for this many device classes",
        )
    vectors = count_vectors(ev.cluster.class_sizes)
    columns = {ts: [v for v in vectors if ev.group(ts, v).feasible] for ts in task_sets}
    best: tuple[float, Grouping, tuple[Counts, ...]] | None = None
    bound = math.inf
    for grouping in groupings:
        found = _solve_grouping(ev, grouping, columns, cfg)
        if found is None:
            continue
        value, lower, counts = found
        bound = min(bound, lower)
        if best is None or value < best[0] - 1e-9:
            best = (value, grouping, counts)
    if best is None:
        raise ConfigError("workload", "no grouping of the tasks fits in memory on these devices")
    _, grouping, counts = best
    score = ev.score(grouping, list(counts))
    gap = max(0.0, (score.seconds - bound) / score.seconds) if math.isfinite(bound) else 0.0
    return ExactResult(
        grouping,
        counts,
        score,
        bound,
        gap,
        sum(len(c) for c in columns.values()),
        len(groupings),
        time.perf_counter() - start,
        ev.evaluations,
    )


def _solve_grouping(
    ev: Evaluator, grouping: Grouping, columns: dict[tuple[str, ...], list[Counts]], cfg: ExactConfig
) -> tuple[float, float, tuple[Counts, ...]] | None:
    m = len(grouping)
    cols = [columns[g] for g in grouping]
    if any(not c for c in cols):
        return None
    n_cls = ev.cluster.n_classes
    paths = ev.paths(grouping)
    g_gen = next(i for i, g in enumerate(grouping) if "generate" in g)
    g_train = next(i for i, g in enumerate(grouping) if "actor_train" in g)
    synced = g_gen != g_train
    # transfers: (src, dst, bytes); the sync's cross part is one more
    edges = sorted({e for p in paths for e in p.transfers})
    transfers = [(s, d, ev.payload_bytes[pl]) for s, d, pl in edges]
    if synced:
        transfers.append((g_train, g_gen, ev.sync_bytes))
    pair_ok = np.isfinite(ev.class_delay)
    pairs = [(a, b) for a in range(n_cls) for b in range(n_cls) if pair_ok[a, b]]

    # variable layout
    off_x = []
    pos = 0
    for column in cols:
        off_x.append(pos)
        pos += len(column)
    off_y = pos
    pos += m * n_cls
    off_z = pos
    pos += len(transfers) * len(pairs)
    off_r = pos
    pos += len(transfers)
    i_s = pos
    pos += 1
    i_t = pos
    pos += 1
    nvar = pos

    rows: list[tuple[dict[int, float], float, float]] = []
    coef: dict[int, float]
    for g in range(m):
        rows.append(({off_x[g] + j: 1.0 for j in range(len(cols[g]))}, 1.0, 1.0))
    for k in range(n_cls):
        coef = {off_x[g] + j: float(vec[k]) for g in range(m) for j, vec in enumerate(cols[g]) if vec[k]}
        if coef:
            rows.append((coef, -np.inf, float(ev.cluster.class_sizes[k])))
    for g in range(m):
        for k in range(n_cls):
            coef = {off_y + g * n_cls + k: 1.0}
            for j, vec in enumerate(cols[g]):
                if vec[k]:
                    coef[off_x[g] + j] = -1.0
            rows.append((coef, -np.inf, 0.0))
    for e, (src, dst, nbytes) in enumerate(transfers):
        base = off_z + e * len(pairs)
        rows.append(({base + p: 1.0 for p in range(len(pairs))}, 1.0, 1.0))
        coef = {off_r + e: -1.0}
        for p, (ka, kb) in enumerate(pairs):
            rows.append(({base + p: 1.0, off_y + src * n_cls + ka: -1.0}, -np.inf, 0.0))
            rows.append(({base + p: 1.0, off_y + dst * n_cls + kb: -1.0}, -np.inf, 0.0))
            coef[base + p] = float(ev.class_delay[ka, kb] + nbytes / ev.class_bw[ka, kb])
        rows.append((coef, -np.inf, 0.0))
    if synced:
        # sync >= host + cross and >= host + internal, host = the trainers' packing + the generators'
        # loading: one column of each group is chosen, so both are linear in the columns
        host = {off_x[g_train] + j: ev.host_time(vec, "publish") for j, vec in enumerate(cols[g_train])}
        for j, vec in enumerate(cols[g_gen]):
            host[off_x[g_gen] + j] = ev.host_time(vec, "load")
        rows.append(({i_s: -1.0, off_r + len(transfers) - 1: 1.0, **host}, -np.inf, 0.0))
        coef = {i_s: -1.0, **host}
        for j, vec in enumerate(cols[g_gen]):
            coef[off_x[g_gen] + j] += ev.sync_internal(vec)
        rows.append((coef, -np.inf, 0.0))
    where = {t: g for g, grp in enumerate(grouping) for t in grp}
    edge_index = {e: i for i, e in enumerate(edges)}
    k_stale = ev.workload.staleness
    for path in paths:
        if k_stale > 0 and not path.cycle:
            continue
        coef = {i_t: -float(k_stale + 1)}
        for t in path.tasks:
            g = where[t]
            for j, vec in enumerate(cols[g]):
                coef[off_x[g] + j] = coef.get(off_x[g] + j, 0.0) + ev.group(grouping[g], vec).seconds(t)
        for edge in path.transfers:
            coef[off_r + edge_index[edge]] = coef.get(off_r + edge_index[edge], 0.0) + 1.0
        if path.sync:
            coef[i_s] = 1.0
        rows.append((coef, -np.inf, 0.0))
    if k_stale > 0:
        for g in range(m):
            coef = {i_t: -1.0}
            for j, vec in enumerate(cols[g]):
                coef[off_x[g] + j] = ev.group(grouping[g], vec).busy
            rows.append((coef, -np.inf, 0.0))

    a = lil_matrix((len(rows), nvar))
    lb, ub = np.empty(len(rows)), np.empty(len(rows))
    for r, (coef, lo, hi) in enumerate(rows):
        for j, v in coef.items():
            a[r, j] = v
        lb[r], ub[r] = lo, hi
    objective = np.zeros(nvar)
    objective[i_t] = 1.0
    integrality = np.zeros(nvar)
    integrality[:off_y] = 1
    upper = np.ones(nvar)
    upper[off_r:] = np.inf
    res = milp(
        objective,
        constraints=LinearConstraint(a.tocsr(), lb, ub),
        integrality=integrality,
        bounds=(np.zeros(nvar), upper),
        options={"time_limit": cfg.time_limit, "mip_rel_gap": 1e-9},
    )
    if res.x is None:
        return None
    x = res.x
    counts = tuple(cols[g][int(np.argmax(x[off_x[g] : off_x[g] + len(cols[g])]))] for g in range(m))
    lower = getattr(res, "mip_dual_bound", None)
    lower = float(lower) if lower is not None and np.isfinite(lower) else float(res.fun)
    return float(res.fun), lower, counts
