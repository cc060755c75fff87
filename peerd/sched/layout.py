"""Between the search's index layouts and id-based ``Allocation``s, and re-scoring an allocation as given.

``score_allocation`` is what a peer runs on someone else's candidate: it trusts
nothing but the device ids, uses the stage order and replica pairing exactly as
written, and recomputes the cost with its own objective.
"""

from __future__ import annotations

import numpy as np

from peerd.errors import ConfigError
from peerd.sched.allocation import Allocation
from peerd.sched.objective import Cost, Edge, Evaluation, Objective


def to_allocation(obj: Objective, ev: Evaluation) -> Allocation:
    """The allocation of a layout: stages in ``ev.order``, replicas following the bottleneck matchings."""
    ids = obj.problem.ids
    stages_idx = [ev.groups[g] for g in ev.order]
    edges = obj.path_edges(ev.groups, ev.order)
    columns = [list(range(len(stages_idx[0])))]  # positions in each stage's sorted members
    for e in edges:
        columns.append([e.perm[p] for p in columns[-1]])
    stages = [[ids[int(stages_idx[k][p])] for p in columns[k]] for k in range(len(stages_idx))]
    layers = obj.layer_split([obj.group(g) for g in stages_idx], edges)
    alloc = Allocation(tuple(tuple(s) for s in stages), tuple(ids[int(d)] for d in ev.spares), layers)
    if not obj.orientation_matters and len(stages) > 1:
        # Symmetric costs: both directions score the same, pick one deterministically.
        rev = Allocation(alloc.stages[::-1], alloc.spares, layers[::-1] if layers else None)
        if min(rev.stages[0]) < min(alloc.stages[0]):
            alloc = rev
    return alloc.canonical()


def from_allocation(obj: Objective, alloc: Allocation) -> Evaluation:
    """Index layout of ``alloc`` with its stage order (cost with re-optimised matchings)."""
    groups, spares = _indices(obj, alloc)
    return obj.evaluate(groups, spares, order=list(range(len(groups))))


def score_allocation(obj: Objective, alloc: Allocation) -> Cost:
    """Cost of ``alloc`` exactly as written: its stage order and its replica pairing."""
    groups, spares = _indices(obj, alloc)
    index = obj.problem.index
    edges = []
    for k in range(len(alloc.stages) - 1):
        a = np.array([index[d] for d in alloc.stages[k]])
        b = np.array([index[d] for d in alloc.stages[k + 1]])
        matched = obj.pair_cost[a, b]  # replica j: a[j] -> b[j]
        sa, sb = np.argsort(a), np.argsort(b)
        pos_b = np.empty(len(b), dtype=np.intp)
        pos_b[sb] = np.arange(len(b))
        perm = tuple(int(pos_b[j]) for j in sa)  # sorted position in a -> sorted position in b
        value = float(matched.max())
        worst = tuple(int(i) for i, j in enumerate(sa) if matched[j] >= value - 1e-12)
        edges.append(Edge(value, float(matched.mean()), perm, worst))
    return obj.combine([obj.group(g) for g in groups], edges, spares)


def _indices(obj: Objective, alloc: Allocation) -> tuple[list[np.ndarray], np.ndarray]:
    index, shape = obj.problem.index, obj.shape
    if (alloc.d_pp, alloc.d_dp) != (shape.d_pp, shape.d_dp):
        raise ConfigError("stages", f"allocation is {alloc.d_pp}x{alloc.d_dp}, the objective expects {shape}")
    unknown = [d for d in alloc.devices + list(alloc.spares) if d not in index]
    if unknown:
        raise ConfigError("stages", f"devices not in the scenario: {unknown[:5]}")
    used = {index[d] for d in alloc.devices}
    if len(used) != len(alloc.devices):
        raise ConfigError("stages", "a device appears twice")
    groups = [np.sort(np.array([index[d] for d in stage], dtype=np.intp)) for stage in alloc.stages]
    spares = np.array(sorted(set(range(obj.problem.n)) - used), dtype=np.intp)
    return groups, spares
