"""Starting layouts: cluster-aware constructions (greedy, no search) and random balanced partitions.

The constructions never look at the order devices are listed in. They chain the
devices so that well-connected ones are adjacent (average-linkage clustering on
the pair transfer cost, leaves in dendrogram order), then lay the chain onto the
(stage x replica) grid in blocks of h stages x w replicas for every divisor pair:
whole rows give groups inside clusters (cheap data-parallel traffic), whole
columns give pipelines inside clusters (cheap pipeline traffic), and the blocks
in between mix both (half of each group in each of two data centres; a 4-GPU
instance holding 4 consecutive stages of one pipeline). With spares allowed, the active devices are the best ones by
a speed-and-connectivity score.
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage
from scipy.spatial.distance import squareform

from peerd.sched.objective import Cost, Evaluation, Objective


def device_chains(distance: np.ndarray, max_cuts: int = 4) -> list[np.ndarray]:
    """Orders of the devices in which well-connected devices are adjacent.

    The first is the dendrogram leaf order of average-linkage clustering on the
    (symmetrised) distance; the others cut the dendrogram at a few merge heights
    and list the clusters largest first (so equal-size clusters line up on the grid).
    """
    n = distance.shape[0]
    if n <= 2:
        return [np.arange(n)]
    d = (distance + distance.T) / 2.0
    np.fill_diagonal(d, 0.0)
    z = linkage(squareform(d, checks=False), method="average")
    leaves = leaves_list(z).astype(np.intp)
    rank = np.empty(n, dtype=np.intp)
    rank[leaves] = np.arange(n)
    chains = [leaves]
    heights = np.unique(z[:, 2])
    if len(heights) > max_cuts:
        heights = heights[np.linspace(0, len(heights) - 1, max_cuts).round().astype(int)]
    for t in heights:
        labels = fcluster(z, t, criterion="distance")
        size = np.bincount(labels)
        first = np.full(labels.max() + 1, n)
        np.minimum.at(first, labels, rank)
        chains.append(np.lexsort((rank, first[labels], -size[labels])).astype(np.intp))
    unique = {c.tobytes(): c for c in chains}
    return list(unique.values())


def grid_groups(
    chain: np.ndarray, d_pp: int, d_dp: int, h: int, w: int, blocks_across: bool, inner_across: bool
) -> list[np.ndarray]:
    """The groups (sorted rows) of ``grid_layout``."""
    return [np.sort(row) for row in grid_layout(chain, d_pp, d_dp, h, w, blocks_across, inner_across)]


def grid_layout(
    chain: np.ndarray, d_pp: int, d_dp: int, h: int, w: int, blocks_across: bool, inner_across: bool
) -> np.ndarray:
    """Lay ``chain`` onto the (stage x replica) grid in h x w blocks; the rows are the groups.

    Blocks are visited across the replicas first (``blocks_across``) or down the
    stages first, and so are the cells inside a block (``inner_across``). A cluster
    of h * w consecutive chain devices thus lands in one block: h stages of w
    pipelines. (h=1, w=d_dp): groups along the chain; (h=d_pp, w=1): pipelines along it.
    """
    assert d_pp % h == 0 and d_dp % w == 0 and len(chain) == d_pp * d_dp
    cells: list[tuple[int, int]] = []  # (stage, replica) in visiting order
    outer = [(br, bc) for br in range(d_pp // h) for bc in range(d_dp // w)]
    if not blocks_across:
        outer.sort(key=lambda rc: (rc[1], rc[0]))
    inner = [(r, c) for r in range(h) for c in range(w)]
    if not inner_across:
        inner.sort(key=lambda rc: (rc[1], rc[0]))
    for br, bc in outer:
        cells.extend((br * h + r, bc * w + c) for r, c in inner)
    grid = np.empty((d_pp, d_dp), dtype=np.intp)
    rows, cols = zip(*cells, strict=True)
    grid[list(rows), list(cols)] = chain
    return grid


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def active_devices(obj: Objective, count: int) -> np.ndarray:
    """The ``count`` devices to use when spares are allowed: fastest and best connected first."""
    n = obj.problem.n
    if count >= n:
        return np.arange(n)
    # Median link cost to the others is robust to a few bad pairs; compute speed enters when known.
    link = np.median(obj.pair_cost + np.diag(np.full(n, np.nan)), axis=1) if n > 1 else np.zeros(n)
    link = np.nan_to_num(link, nan=0.0)
    tflops = obj.speed
    speed = tflops / tflops.max() if tflops.max() > 0 else np.ones(n)
    score = link / (link.max() or 1.0) - speed
    return np.sort(np.argsort(score, kind="stable")[:count])


def constructions(obj: Objective, exact_limit: int | None = None) -> list[Evaluation]:
    """The greedy seed family for ``obj``'s shape (deduplicated, evaluated, best first).

    Every layout is first scored as laid out (chain order, no matching: cheap); only
    the best ``exact_limit`` (default: all up to ~4k devices in total) get the exact
    evaluation with bottleneck matchings and TSP order.
    """
    shape, n = obj.shape, obj.problem.n
    if exact_limit is None:
        exact_limit = max(8, 4096 // n)
    active = active_devices(obj, shape.active)
    spares = np.setdiff1d(np.arange(n), active)
    sub = obj.pair_cost[np.ix_(active, active)]
    seen: set[tuple[bytes, ...]] = set()
    laid: list[tuple[Cost, int, np.ndarray]] = []  # (cost as laid out, tie-break, grid)
    for chain in device_chains(sub):
        chain = active[chain]
        for h in divisors(shape.d_pp):
            for w in divisors(shape.d_dp):
                for blocks_across in (True, False):
                    for inner_across in (True, False):
                        grid = grid_layout(chain, shape.d_pp, shape.d_dp, h, w, blocks_across, inner_across)
                        key = tuple(sorted(np.sort(row).tobytes() for row in grid))
                        if key not in seen:
                            seen.add(key)
                            laid.append((obj.grid_cost(grid, spares), len(laid), grid))
    laid.sort(key=lambda x: (x[0], x[1]))
    out = [obj.evaluate(list(grid), spares) for _, _, grid in laid[:exact_limit]]
    out.sort(key=lambda ev: ev.cost)
    return out


def random_layout(obj: Objective, rng: np.random.Generator) -> Evaluation:
    """A uniformly random balanced partition (random active set when spares are allowed)."""
    shape = obj.shape
    perm = rng.permutation(obj.problem.n)
    groups = [np.sort(perm[g * shape.d_dp : (g + 1) * shape.d_dp]) for g in range(shape.d_pp)]
    return obj.evaluate(groups, np.sort(perm[shape.active :]))
