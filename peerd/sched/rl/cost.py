"""Cost terms of the RL workflow: seconds of each task on a tasklet grid, from device and link parameters.

Notation (SI): P params (in FLOP and weight-read terms the weights a token multiplies,
``ModelSize.flop_params``: embeddings aside), L layers, h hidden, F device FLOP/s, B memory
bytes/s, e_c / e_m the compute / memory efficiencies, α one-way delay (s), β link bytes/s, N
sequences of T = T_p + T_r tokens, of which a forward over a whole sequence runs T - 1 positions
(the last token's logits are never needed: written T below), micro-batches of m sequences; ``ar(x, n) = 2(n-1)/n · x/β_min + 2(n-1)·α_max`` is a ring
all-reduce of x bytes over n devices (reduce-scatter + all-gather).

- **Tensor-parallel traffic** of k tokens through ℓ layers with a all-reduces per layer:
  ``a · ℓ · ar(k · h · b_act, tp)`` over the links among the tp ranks.
- **Generation**, replica of tp devices (F_r = tp·min F·e_c, B_r = tp·min B·e_m), S sequences:
  KV bytes per sequence ``kv = kv_tok · T``; concurrency cap ``C = floor(tp · free / kv)`` with
  ``free`` the least memory left on a rank after its weight shard; ``W = ceil(S / C)`` waves of
  ``c = S / W`` sequences; ``prefill = 2 P c T_p / F_r + TP(c T_p, L, 2)`` per wave;
  ``step = max((P b_w + c · kv_tok · (T_p + T_r/2)) / B_r, 2 P c / F_r) + TP(c, L, 2)``
  (roofline: weights and the average KV read per decode step, or compute);
  ``time = W · (prefill + (T_r - 1) · step)`` (the prefill's logits sample the first token).
- **Inference** (forward), replica of pp stages, ``M = ceil(S / m)`` micro-batches: per stage and
  micro-batch ``c_s = 2 (P/pp) m T / (tp · min F · e_c) + TP(m T, L/pp, 2)``; per boundary
  ``x_s = max_ranks (α + m T h b_act / tp / β)``; ``time = (M + pp - 1) · max(c_s, x_s)``
  (every slot of the pipeline waits for its slowest stage or transfer; pp - 1 slots of bubble).
- **Training** (forward + backward, ×4 forward FLOPs with recomputation, ×3 without), per
  optimizer step with ``M = ceil(S / (m · steps))``: ``c_s`` as above with that factor and 4
  all-reduces per layer, slot ``max(c_s, 2 x_s)`` (activations forward, gradients back), then
  the data-parallel all-reduce of each stage's gradients ``ar(P/(pp·tp) · b_g, dp)`` among the dp
  devices holding the same (stage, rank), the slowest group counting:
  ``time = steps · (max_replicas (M + pp - 1) · slot + max_groups ar)``.
- **Load balancing**: sequences go to replicas in proportion to their rate at an even split
  (``balanced``), or evenly (as verl does); a task takes as long as its slowest replica.
- **Transfer** of x bytes between two groups: through the best pair, ``min_{i∈A, j∈B} α_ij + x/β_ij``.
- **FSDP (ZeRO-3) tasks** (only the verl-like baseline; peerd's layouts replicate weights per
  data-parallel replica): every device holds 1/n of the parameters, so each micro-batch first
  all-gathers them, ``ag(x, n) = (n-1)/n · x/β_min + (n-1)·α_max`` (the ring convention of
  ``ar``, whose halves are ``ag`` and ``rs``; ``rs`` has the same form). Per micro-batch of m
  sequences the collectives are ``ag(P b_w, n)`` in inference and ``2 ag(P b_w, n) + rs(P b_r, n)``
  in training (forward gather, backward gather, gradient reduce-scatter with b_r the reduce
  dtype's bytes), overlapped with compute at best (FSDP prefetches the next unit's gather):
  ``slot = max(max_devices c, collectives)`` with ``c`` the slot above at pp = tp = 1; every
  device takes ``M = ceil(S / (n m steps))`` micro-batches per step, and the collectives hold
  all devices in lockstep: ``time = steps · M · slot``. No separate data-parallel all-reduce.
- **HSDP** (verl's ``fsdp_size`` f < n, HYBRID_SHARD): the n devices in scenario order form
  r = n/f shard groups of f consecutive devices (ranks ``k f .. k f + f - 1``) and f replica
  groups of r devices (ranks ``j, j + f, ...``). Gathers and the reduce-scatter run inside the
  shard groups, ``ag(P b_w, f)`` and ``rs(P b_r, f)`` priced on the slowest shard group; then each
  device all-reduces its fp32 gradient shard across its replica group,
  ``ar(P b_r / f, r)`` on the slowest replica group. verl's actor calls ``backward()`` on every
  micro-batch with no ``no_sync`` / ``set_requires_all_reduce(False)``, and FSDP's post-backward
  hook then reduce-scatters and all-reduces on every backward, so the all-reduce is part of every
  training micro-batch's collectives (overlapped with compute like the rest):
  ``slot = max(c, 2 ag(P b_w, f) + rs(P b_r, f) + ar(P b_r / f, r))``; inference
  ``max(c, ag(P b_w, f))``. f = n is FULL_SHARD (no all-reduce); f = 1 is plain data parallel
  (no gathers, an ``ar(P b_r, n)`` per micro-batch).
- **Colocated reshard** (FSDP actor training that shares its devices with generation): after the
  update each device gathers the full new weights for the rollout engine inside its shard group,
  ``ag(P b_w, f)`` once per iteration, counted in actor training.
- **Launches**: every op the runtime dispatches costs the device's λ (``launch``, seconds) on top of
  its arithmetic; the workload counts them per unit (``Launches``): a generation wave adds
  ``λ (n_gen + n_seq · c + n_dec · T_r)``, an inference or training micro-batch adds ``λ n_mb / pp``
  to its stage's compute, an optimizer step ``λ n_opt / pp``, and each task's per-iteration set-up
  ``λ n_task`` once (λ of the slowest device holding the task). A tiny model is all launches.
- **Op traffic**: the bytes those ops read and write beyond the weights (logits and their softmax,
  norms, the KV cache, gradients, optimizer moments; ``Launches.*_bytes*``, counted on the runtime's
  code) cost 1 / memory bandwidth each: a generation wave ``c · y_gen / B_r``, a micro-batch
  ``m · y_mb / (pp · tp · B · e_m)`` on its stage, an optimizer step ``y_opt / (pp · B · e_m)``.
- **Element work**: the GELU, softmax and attention units of those ops (``Launches.*_elements``,
  per sequence) cost the device's ``element_ns`` per unit beyond their launch and traffic
  (``peerd.sched.elements``; the slowest rank's): a generation wave ``c · u_gen / tp``, a
  micro-batch ``m · u_mb / (pp · tp)`` on its stage.
- **Weight sync** (actor bytes X = P b_w) when generation and actor training use different
  devices: into the generator group over its best link from the trainers, then along the
  generators' maximum-bandwidth spanning tree (pipelined chunks):
  ``max(min_{i,j} α_ij + X/β_ij,  X/β_tree + α_max)``, β_tree = the tree's narrowest edge
  (``relay``); or (``star``, what peerd's rl runtime does) every generator g receives X from one
  trainer h, whose uplink sends the copies one after another:
  ``min_h (max_g α_hg + Σ_g X/β_hg)``. Either way the trainers first pack the new weights
  (``publish`` ops and ``publish_bytes``, the slowest trainer's) and every generator then checks
  and loads what it received (``load`` and ``load_bytes``, the slowest generator's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from peerd.sched.rl.cluster import Cluster
from peerd.sched.rl.workload import ModelSize, Workload

INF = math.inf


def allreduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` devices: 2(n-1)/n · nbytes/β + 2(n-1)·α."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / beta + 2.0 * (n - 1) * alpha


def allgather(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all over ``n`` devices: (n-1)/n · nbytes/β + (n-1)·α."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / beta + (n - 1) * alpha


def fsdp_collectives(model: ModelSize, w: Workload, n: int, alpha: float, beta: float, train: bool) -> float:
    """Seconds of ZeRO-3 collectives per micro-batch on ``n`` devices (forward gather; + backward
    gather and gradient reduce-scatter when training)."""
    k = w.constants
    gather = allgather(model.params * k.weight_bytes, n, alpha, beta)
    if not train:
        return gather
    return 2.0 * gather + allgather(model.params * k.fsdp_reduce_bytes, n, alpha, beta)


def hsdp_allreduce(model: ModelSize, w: Workload, f: int, r: int, alpha: float, beta: float) -> float:
    """Seconds of HSDP's all-reduce of each device's gradient shard (``P b_r / f``) over ``r`` replicas."""
    return allreduce(model.params * w.constants.fsdp_reduce_bytes / f, r, alpha, beta)


def link_extremes(cluster: Cluster, devices: np.ndarray) -> tuple[float, float]:
    """(largest delay, smallest bandwidth) among the ordered pairs of ``devices`` (0, inf for one)."""
    idx = np.asarray(devices, dtype=np.intp).ravel()
    if idx.size <= 1:
        return 0.0, INF
    sub_d = cluster.delay[np.ix_(idx, idx)]
    sub_b = cluster.bw[np.ix_(idx, idx)]
    return float(sub_d.max()), float(sub_b.min())


def tp_traffic(
    tokens: float,
    layers: float,
    per_layer: int,
    hidden: int,
    act_bytes: float,
    tp: int,
    alpha: float,
    beta: float,
) -> float:
    """Seconds of tensor-parallel all-reduces for ``tokens`` through ``layers`` layers."""
    if tp <= 1:
        return 0.0
    return per_layer * layers * allreduce(tokens * hidden * act_bytes, tp, alpha, beta)


@dataclass(frozen=True)
class ReplicaGen:
    """The devices of one generation replica, reduced to what its time needs."""

    flops: float
    """Σ over tp ranks of the slowest rank's FLOP/s (tp · min F)."""
    mem_bw: float
    """tp · min memory bandwidth, bytes/s."""
    free: float
    """Least memory (bytes) left on a rank for the KV cache after parked state and the weight shard."""
    alpha: float
    beta: float
    launch: float = 0.0
    """Largest seconds per dispatched op among the tp ranks."""
    element_s: float = 0.0
    """Seconds per sequence of the generation's element work (``Cluster.element_s``): the slowest
    rank's over tp."""


def generation_time(model: ModelSize, w: Workload, rep: ReplicaGen, tp: int, seqs: float) -> float:
    """Seconds to generate ``seqs`` sequences on one replica; inf when not even one sequence's KV fits."""
    if seqs <= 0:
        return 0.0
    k = w.constants
    kv_tok = model.kv_bytes_per_token(k.kv_bytes)
    cap = math.floor(tp * rep.free / (kv_tok * w.seq_len)) if rep.free > 0 else 0
    if cap < 1:
        return INF
    waves = math.ceil(seqs / cap)
    c = seqs / waves
    flops = rep.flops * k.compute_efficiency
    bw = rep.mem_bw * k.memory_efficiency
    tp_p = tp_traffic(
        c * w.prompt_len, model.layers, 2, model.hidden, k.activation_bytes, tp, rep.alpha, rep.beta
    )
    tp_d = tp_traffic(c, model.layers, 2, model.hidden, k.activation_bytes, tp, rep.alpha, rep.beta)
    prefill = 2.0 * model.flop_params * c * w.prompt_len / flops + tp_p
    read = model.flop_params * k.weight_bytes + c * kv_tok * (w.prompt_len + w.response_len / 2.0)
    step = max(read / bw, 2.0 * model.flop_params * c / flops) + tp_d
    n = w.launches
    ops = n.generate + n.generate_per_sequence * c + n.decode_step * w.response_len
    traffic = c * n.generate_bytes_per_sequence / bw if n.generate_bytes_per_sequence else 0.0
    # the prefill's logits give the first token, each decode step's the next: the last token needs none
    decode_steps = w.response_len - 1
    return waves * (prefill + decode_steps * step + ops * rep.launch + traffic + c * rep.element_s)


@dataclass(frozen=True)
class Pipelines:
    """The dp pipeline replicas of a task: per-stage compute speed and TP links, per-boundary links."""

    stage_flops: np.ndarray
    """(dp, pp) the slowest rank's FLOP/s in each stage."""
    stage_alpha: np.ndarray
    stage_beta: np.ndarray
    """(dp, pp) largest delay / smallest bandwidth among each stage's tp ranks (0 / inf for tp = 1)."""
    hop_alpha: np.ndarray
    hop_beta: np.ndarray
    """(dp, pp - 1, tp) delay and bandwidth from stage s rank t to stage s+1 rank t."""
    stage_launch: np.ndarray | None = None
    """(dp, pp) the slowest rank's seconds per dispatched op (None: not modelled)."""
    stage_mem_bw: np.ndarray | None = None
    """(dp, pp) the slowest rank's memory bytes/s (None: the ops' traffic is not modelled)."""
    stage_element_s: np.ndarray | None = None
    """(dp, pp, 3) the slowest rank's ``Cluster.element_s`` (None: element work is not modelled)."""

    @classmethod
    def of(cls, cluster: Cluster, grid: np.ndarray) -> Pipelines:
        """From a (dp, pp, tp) tasklet grid; the diagonal (0 delay, inf bandwidth) never sets an extreme."""
        pair_d = cluster.delay[grid[..., :, None], grid[..., None, :]]  # (dp, pp, tp, tp)
        pair_b = cluster.bw[grid[..., :, None], grid[..., None, :]]
        return cls(
            stage_flops=cluster.flops[grid].min(axis=2),
            stage_alpha=pair_d.max(axis=(2, 3)),
            stage_beta=pair_b.min(axis=(2, 3)),
            hop_alpha=cluster.delay[grid[:, :-1], grid[:, 1:]],
            hop_beta=cluster.bw[grid[:, :-1], grid[:, 1:]],
            stage_launch=cluster.launch[grid].max(axis=2),
            stage_mem_bw=cluster.mem_bw[grid].min(axis=2),
            stage_element_s=cluster.element_s[grid].max(axis=2),
        )


def tp_traffic_array(
    tokens: float,
    layers: float,
    per_layer: int,
    hidden: int,
    act_bytes: float,
    tp: int,
    alpha: np.ndarray,
    beta: np.ndarray,
) -> np.ndarray:
    """``tp_traffic`` elementwise over arrays of link extremes."""
    if tp <= 1:
        return np.zeros_like(alpha)
    nbytes = tokens * hidden * act_bytes
    return per_layer * layers * (2.0 * (tp - 1) / tp * nbytes / beta + 2.0 * (tp - 1) * alpha)


def pipeline_slots(model: ModelSize, w: Workload, pipes: Pipelines, tp: int, train: bool) -> np.ndarray:
    """(dp,) seconds of one pipeline slot per replica: its slowest stage's micro-batch compute or transfer."""
    k = w.constants
    pp = pipes.stage_flops.shape[1]
    tokens = w.micro_batch * w.forward_len
    factor = (8.0 if k.recompute else 6.0) if train else 2.0
    per_layer = 4 if train else 2
    compute = factor * (model.flop_params / pp) * tokens / (tp * pipes.stage_flops * k.compute_efficiency)
    n = w.launches
    if pipes.stage_launch is not None:
        compute = compute + (n.train_per_micro_batch if train else n.inference_per_micro_batch) / pp * (
            pipes.stage_launch
        )
    per_sequence = n.train_bytes_per_sequence if train else n.inference_bytes_per_sequence
    if pipes.stage_mem_bw is not None and per_sequence:
        with np.errstate(divide="ignore"):  # a device without a memory bandwidth cannot move the bytes
            compute = compute + w.micro_batch * per_sequence / (
                pp * tp * pipes.stage_mem_bw * k.memory_efficiency
            )
    if pipes.stage_element_s is not None:
        compute = compute + w.micro_batch * pipes.stage_element_s[..., 2 if train else 1] / (pp * tp)
    compute = compute + tp_traffic_array(
        tokens,
        model.layers / pp,
        per_layer,
        model.hidden,
        k.activation_bytes,
        tp,
        pipes.stage_alpha,
        pipes.stage_beta,
    )
    slot = compute.max(axis=1)
    if pp > 1:
        xfer = (pipes.hop_alpha + tokens * model.hidden * k.activation_bytes / tp / pipes.hop_beta).max(
            axis=(1, 2)
        )
        slot = np.maximum(slot, (2.0 if train else 1.0) * xfer)
    return slot


def host_work(ops: float, nbytes: float, launch: float, mem_bw: float) -> float:
    """Seconds of ``ops`` dispatched ops moving ``nbytes`` on a device (``mem_bw``: achieved bytes/s;
    none measured: the bytes cannot move)."""
    if not nbytes:
        return ops * launch
    return ops * launch + (nbytes / mem_bw if mem_bw > 0 else INF)


def task_launches(w: Workload, train: bool, pp: int, launch: float, mem_bw: float) -> tuple[float, float]:
    """(seconds per iteration, seconds per optimizer step) of a task's ops outside its micro-batches
    (``mem_bw``: the slowest device's memory bytes/s, for the optimizer step's traffic)."""
    n = w.launches
    if train:
        bw = mem_bw * w.constants.memory_efficiency
        return n.train * launch, host_work(n.optimizer_step, n.optimizer_step_bytes, launch, bw) / pp
    return n.inference * launch, 0.0


def pipeline_time(micro_batches: int, pp: int, slot: float) -> float:
    """(M + pp - 1) slots: M micro-batches plus the pipeline's fill and drain."""
    return 0.0 if micro_batches <= 0 else float((micro_batches + pp - 1) * slot)


def balanced_split(
    total: float, n: int, time_of: Callable[[int, float], float], balanced: bool
) -> list[float]:
    """Sequences per replica: in proportion to each replica's rate at an even split, or evenly."""
    even = total / n
    if not balanced or n == 1:
        return [even] * n
    times = [time_of(r, even) for r in range(n)]
    if any(not math.isfinite(t) for t in times):
        return [even] * n
    rates = [even / t if t > 0 else INF for t in times]
    if any(math.isinf(r) for r in rates):
        return [even] * n
    s = sum(rates)
    return [total * r / s for r in rates]


def transfer_time(nbytes: float, alpha: np.ndarray, beta: np.ndarray) -> float:
    """Best-pair transfer of ``nbytes``: min over the given pairs of α + nbytes/β."""
    return float((alpha + nbytes / beta).min())


def tree_bottleneck(cluster: Cluster, devices: list[int]) -> float:
    """Narrowest edge (bytes/s) of the maximum-bandwidth spanning tree over ``devices`` (inf for one)."""
    if len(devices) <= 1:
        return INF
    idx = np.asarray(devices, dtype=np.intp)
    sub = cluster.bw[np.ix_(idx, idx)]
    sym = np.minimum(sub, sub.T)
    n = len(idx)
    inside = np.zeros(n, dtype=bool)
    inside[0] = True
    best = sym[0].copy()
    narrowest = INF
    for _ in range(n - 1):  # Prim on -bandwidth: always add the widest edge leaving the tree
        cand = np.where(inside, -INF, best)
        j = int(np.argmax(cand))
        narrowest = min(narrowest, float(cand[j]))
        inside[j] = True
        best = np.maximum(best, sym[j])
    return narrowest


def sync_internal(cluster: Cluster, gen_devices: list[int], nbytes: float) -> float:
    """Relay of ``nbytes`` along the generators' widest spanning tree: X/β_tree + largest delay."""
    if len(gen_devices) <= 1:
        return 0.0
    alpha, _ = link_extremes(cluster, np.asarray(gen_devices))
    return nbytes / tree_bottleneck(cluster, gen_devices) + alpha


def sync_star(delay: np.ndarray, bw: np.ndarray, counts: np.ndarray, nbytes: float) -> float:
    """Star sync from the best sender: ``min_h (max_g α_hg + Σ_g n_g · X/β_hg)``.

    ``delay``, ``bw``: (senders, receiver kinds) links; ``counts``: receivers of each kind.
    """
    if not counts.any():
        return 0.0
    used = counts > 0
    per_sender = delay[:, used].max(axis=1) + (counts[used] * nbytes / bw[:, used]).sum(axis=1)
    return float(per_sender.min())
