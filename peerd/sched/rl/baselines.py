"""Baselines in the same cost model: verl-like (everything colocated) and StreamRL-like (generation disaggregated).

- **verl-like**: one group of every device time-sharing all tasks (verl's colocated "hybrid
  engine" with its FSDP backend and vLLM rollout), priced as verl runs it, with the best of the
  knobs verl's configuration offers (a verl user tunes them; verl's placement stays
  network-unaware: its device mesh takes the ranks in device order):

  - generation: vLLM replicas of tp devices, data parallel over the rest, no pipeline; the best
    tp of ``TP_DEGREES`` is taken;
  - reference log-probs and actor training: FSDP (ZeRO-3, ``Layout(n, 1, 1, fsdp=True,
    fsdp_size=f, micro_batch=m)``) with no tensor or pipeline parallelism. verl's FSDP workers
    build their device mesh with ``create_device_mesh(world_size, fsdp_size)``: a 1-D mesh over
    the whole world (FULL_SHARD) when ``fsdp_config.fsdp_size`` is -1 (the default) or >= n,
    else a 2-D ``(n/f, f)`` mesh named ``("ddp", "fsdp")`` with HYBRID_SHARD: parameters sharded
    inside each group of f consecutive ranks, replicated across the n/f groups. The actor loops
    over the micro-batches of each mini-batch with a forward and backward each and steps the
    optimizer once per mini-batch, so every micro-batch gathers the parameters in the forward
    and again in the backward inside its shard group, reduce-scatters the gradients there (fp32
    by default) and, under HSDP, all-reduces its gradient shard across the replica group (FSDP
    does so on every backward unless told not to, which verl does not). The reference's
    log-prob pass gathers once per micro-batch. Per micro-batch
    ``max(compute, 2 ag(P b_w, f) + rs(P b_r, f) + ar(P b_r / f, n/f))`` in training and
    ``max(compute, ag(P b_w, f))`` in inference, each collective priced on the slowest link
    among its members, the slowest group counting (``peerd.sched.rl.cost``);
    ``M = ceil(S / (n m steps))`` micro-batches per device and step;
  - resharding: before each generation the FSDP-to-vLLM sharding manager materialises each full
    tensor on every rank for vLLM's loader: ``ag(P b_w, f)`` per iteration (the colocated plan's
    weight sync);
  - the configuration: verl-like = ``min`` over f in the divisors of n (1 = plain data
    parallel with a full replica per device, n = FULL_SHARD) and, per FSDP task, over the
    micro-batch m in 1..ceil(S / (n steps)) (``ppo_micro_batch_size_per_gpu`` for training,
    ``log_prob_micro_batch_size_per_gpu`` for the reference; any value verl accepts) of the
    configurations that fit in memory (sharded state parked 1/f per device, gradients 1/f,
    gathered layers, activations of m sequences); the chosen f, m and tp are reported
    (``VerlChoice``).

  Replicas get equal shares (no load balancing: verl assumes identical GPUs). Sources: verl's
  docs, "PyTorch FSDP Backend" (workers and the FSDPVLLMShardingManager, whose resharding
  overhead they call larger than Megatron's); verl's ``workers/actor/dp_actor.py``
  (``update_policy``: ``loss.backward()`` per micro-batch, one optimizer step per mini-batch),
  ``workers/fsdp_workers.py`` (``create_device_mesh`` / ``get_sharding_strategy``: FULL_SHARD on
  a 1-D mesh, HYBRID_SHARD on the ``(n/f, f)`` mesh; reduce dtype fp32; engine config
  ``fsdp_size: -1``, "Number of GPUs in each FSDP shard group; -1 means auto") and
  ``workers/sharding_manager/fsdp_vllm.py`` (full tensors handed to vLLM's ``load_weights``);
  PyTorch: a 2-D mesh's outer dimension replicates and its inner one shards (HSDP), and HSDP
  reduce-scatters then all-reduces per backward unless ``set_requires_all_reduce(False)``
  (pytorch/pytorch#126166). Not charged (kept in verl's favour): the actor's old-log-prob pass
  verl runs before the update (the workflow has no such task for any plan), per-layer
  collective latencies (each pass is priced as one collective), and a third gather when
  recomputation re-runs a layer's forward.
- **StreamRL-like**: generation on one pool, every other task on the other; pools are unions of
  device types (GPU models), the best split of all; equal shares inside each task.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from peerd.sched.rl.cluster import Cluster
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping, Score
from peerd.sched.rl.group import evaluate_group
from peerd.sched.rl.layout import TP_DEGREES, Layout
from peerd.sched.rl.workflow import KIND
from peerd.sched.rl.workload import Workload


@dataclass(frozen=True)
class VerlChoice:
    """The verl-like baseline's best configuration and its score."""

    grouping: Grouping
    counts: tuple[Counts, ...]
    score: Score
    fsdp_size: int | None = None
    """verl's ``fsdp_config.fsdp_size`` (n = FULL_SHARD); None when nothing fits."""
    rollout_tp: int | None = None
    micro_batch: dict[str, int] = field(default_factory=dict)
    """Task -> sequences per micro-batch per device (the FSDP tasks)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "fsdp_size": self.fsdp_size,
            "rollout_tp": self.rollout_tp,
            "micro_batch": dict(self.micro_batch),
        }


def verl_like(cluster: Cluster, workload: Workload) -> tuple[Grouping, tuple[Counts, ...], Score]:
    c = verl_like_choice(cluster, workload)
    return c.grouping, c.counts, c.score


def verl_like_choice(cluster: Cluster, workload: Workload) -> VerlChoice:
    """The best verl configuration (fsdp_size, micro-batch per FSDP task, rollout tp) that fits."""
    ev = Evaluator(cluster, workload, balanced=False)
    grouping = (ev.workflow.tasks,)
    counts = (tuple(int(s) for s in cluster.class_sizes),)
    n = cluster.n
    rollout = [Layout(n // tp, 1, tp) for tp in TP_DEGREES if n % tp == 0]
    best = VerlChoice(grouping, counts, Score(math.inf))
    for f in (d for d in range(1, n + 1) if n % d == 0):
        only: dict[str, list[Layout]] = {}
        for t in grouping[0]:
            if t == "generate":
                only[t] = rollout
                continue
            steps = workload.optimizer_steps if KIND[t] == "train" else 1
            top = max(1, math.ceil(workload.sequences / (n * steps)))
            # largest first: among equal times the larger micro-batch is kept
            only[t] = [Layout(n, 1, 1, fsdp=True, fsdp_size=f, micro_batch=m) for m in range(top, 0, -1)]
        result = evaluate_group(cluster, workload, grouping[0], list(range(n)), False, only)
        if result.shortfall is not None:
            score = Score(math.inf, result.shortfall)
            if score.key < best.score.key:
                best = VerlChoice(grouping, counts, score)
            continue
        score = Score(ev.combine(grouping, list(counts), [result])["seconds"])
        if score.key < best.score.key:
            plans = result.plans
            best = VerlChoice(
                grouping,
                counts,
                score,
                fsdp_size=f,
                rollout_tp=plans["generate"].layout.tp if "generate" in plans else None,
                micro_batch={t: p.layout.micro_batch for t, p in plans.items() if p.layout.fsdp},
            )
    return best


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
