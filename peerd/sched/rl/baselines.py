"""Baselines in the same cost model: verl-like (everything colocated) and StreamRL-like (generation disaggregated).

- **verl-like**: one group of every device time-sharing all tasks (verl's colocated "hybrid
  engine" with its FSDP backend and vLLM rollout), priced as verl runs it:

  - generation: vLLM replicas of tp devices, data parallel over the rest, no pipeline; the best
    tp of ``TP_DEGREES`` is taken;
  - reference log-probs and actor training: FSDP (ZeRO-3, ``Layout(n, 1, 1, fsdp=True)``) over
    every device, with no tensor or pipeline parallelism. verl's FSDP workers build a 1-D mesh
    over the whole world (FULL_SHARD) unless an FSDP size is configured; the actor loops over
    the micro-batches of each mini-batch with a forward and backward each and steps the
    optimizer once per mini-batch, so every micro-batch gathers the parameters in the forward
    and again in the backward and reduce-scatters the gradients (in fp32 by default); the
    reference's log-prob pass gathers once per micro-batch. Per micro-batch
    ``max(compute, 2 ag(P b_w) + rs(P b_r))`` in training and ``max(compute, ag(P b_w))`` in
    inference (``peerd.sched.rl.cost``: collectives overlap compute at best);
  - resharding: before each generation the FSDP-to-vLLM sharding manager reads the sharded
    state dict and materialises each full tensor on every rank for vLLM's loader to take its
    tensor-parallel slice: ``ag(P b_w, n)`` per iteration (the colocated plan's weight sync).

  Replicas get equal shares (no load balancing: verl assumes identical GPUs). Sources: verl's
  docs, "PyTorch FSDP Backend" (workers and the FSDPVLLMShardingManager, whose resharding
  overhead they call larger than Megatron's); verl's ``workers/actor/dp_actor.py``
  (``update_policy``: one backward per micro-batch, one optimizer step per mini-batch),
  ``workers/fsdp_workers.py`` (device mesh, FULL_SHARD on a 1-D mesh, reduce dtype fp32) and
  ``workers/sharding_manager/fsdp_vllm.py`` (full tensors handed to vLLM's ``load_weights``).
  Not charged (kept in verl's favour): the actor's old-log-prob pass verl runs before the
  update (the workflow has no such task for any plan), per-layer collective latencies (each
  pass is priced as one collective), and a third gather when recomputation re-runs a layer's
  forward.
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
    sharded = Layout(cluster.n, 1, 1, fsdp=True)
    for tp in TP_DEGREES:
        if cluster.n % tp:
            continue
        only = {t: Layout(cluster.n // tp, 1, tp) if t == "generate" else sharded for t in grouping[0]}
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
