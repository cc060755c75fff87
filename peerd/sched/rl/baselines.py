"""Baselines in the same cost model: verl-like (everything colocated) and StreamRL-like (generation disaggregated).

- **verl-like**: one group of every device time-sharing all tasks with one homogeneous layout:
  data parallel over every device with the same tensor-parallel degree for every task, no
  pipeline (verl's FSDP + vLLM setup); replicas get equal shares (no load balancing: verl
  assumes identical GPUs). The best tensor-parallel degree is taken.
- **StreamRL-like**: generation on one pool, every other task on the other; pools are unions of
  device types (GPU models), the best split of all; equal shares inside each task.
"""

from __future__ import annotations

import itertools
import math

from peerd.sched.rl.cluster import Cluster
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping, Score
from peerd.sched.rl.group import evaluate_group
from peerd.sched.rl.layout import TP_DEGREES, Layout
from peerd.sched.rl.workload import Workload


def verl_like(cluster: Cluster, workload: Workload) -> tuple[Grouping, tuple[Counts, ...], Score]:
    ev = Evaluator(cluster, workload, balanced=False)
    grouping = (ev.workflow.tasks,)
    counts = (tuple(int(s) for s in cluster.class_sizes),)
    best = Score(math.inf)
    for tp in TP_DEGREES:
        if cluster.n % tp:
            continue
        only = {t: Layout(cluster.n // tp, 1, tp) for t in grouping[0]}
        result = evaluate_group(cluster, workload, grouping[0], list(range(cluster.n)), False, only)
        if result.shortfall is not None:
            score = Score(math.inf, result.shortfall)
        else:
            score = Score(ev.combine(grouping, list(counts), [result])["seconds"])
        if score.key < best.key:
            best = score
    return grouping, counts, best


def streamrl_like(cluster: Cluster, workload: Workload) -> tuple[Grouping, tuple[Counts, ...], Score]:
    ev = Evaluator(cluster, workload, balanced=False)
    rest = tuple(t for t in ev.workflow.tasks if t != "generate")
    grouping: Grouping = (("generate",), rest)
    kinds = sorted({_kind(cluster, c) for c in range(cluster.n_classes)})
    best: tuple[Grouping, tuple[Counts, ...], Score] | None = None
    for r in range(1, len(kinds)):
        for gen_kinds in itertools.combinations(kinds, r):
            gen = tuple(
                int(s) if _kind(cluster, c) in gen_kinds else 0 for c, s in enumerate(cluster.class_sizes)
            )
            other = tuple(int(s) - g for s, g in zip(cluster.class_sizes, gen, strict=True))
            score = ev.score(grouping, [gen, other])
            if best is None or score.key < best[2].key:
                best = (grouping, (gen, other), score)
    if best is None:  # one GPU model only: no pool to split by
        return grouping, (), Score(math.inf)
    return best


def _kind(cluster: Cluster, c: int) -> tuple[float, float, float]:
    i = cluster.members[c][0]
    return (float(cluster.flops[i]), float(cluster.memory[i]), float(cluster.mem_bw[i]))
