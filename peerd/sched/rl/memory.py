"""Memory feasibility: bytes each device holds while a task runs, and what a group parks between tasks.

Per device (b_w weights, b_g gradients, b_o optimizer bytes per parameter; tokens of a
micro-batch ``k = m · T``; a stage holds ``L/pp`` layers):

- **parked** (only in a group of several time-shared tasks): every model of the group, weights
  ``P b_w`` plus optimizer state ``P b_o`` of the models trained there, spread over the group's
  devices in proportion to their memory (FSDP-style shards that wait while another task runs);
- **generation**: the weight shard ``P b_w / tp`` plus the KV cache of its concurrent sequences
  (what is left; at least one sequence ``kv_tok · T / tp``);
- **inference**: ``P b_w / (pp tp)`` + one layer's working set ``34 k h / tp`` + on the last stage
  the logits ``k · vocab · b_logit / tp``;
- **training**: ``P (b_w + b_g) / (pp tp)`` + (single-task group) the optimizer shard
  ``P b_o / (pp tp dp)`` + checkpoints of the micro-batches in flight (1F1B: ``min(M, pp - s)`` at
  stage s): ``k (L/pp) h b_act`` each with recomputation (``34 k (L/pp) h / tp`` without) +
  one layer's working set + on the last stage logits and their gradient (2×);
- **FSDP** (ZeRO-3 over n devices, the verl-like baseline; the sharded weights and optimizer
  state are what the group parks): two gathered layers ``2 P b_w / L`` (the one in use and the
  prefetched one) + the inference or training terms above at pp = tp = 1 without the weight
  shard; training adds the gradient shard ``P b_g / n``. Under HSDP with shard groups of f
  devices (verl's ``fsdp_size``) the shards are 1/f, not 1/n: the gradient shard is ``P b_g / f``
  and the group's parked state is spread over each shard group (in proportion to its members'
  memory) instead of over all devices; the micro-batch is the layout's (verl's
  ``*_micro_batch_size_per_gpu``).

A plan is feasible when parked + active ≤ usable memory on every device for every task.
"""

from __future__ import annotations

import numpy as np

from peerd.sched.rl.layout import Layout
from peerd.sched.rl.workflow import KIND, ROLE
from peerd.sched.rl.workload import ModelSize, Workload


def parked_total(w: Workload, tasks: tuple[str, ...]) -> float:
    """Bytes a group of several tasks parks between them (0 for a single-task group)."""
    if len(tasks) <= 1:
        return 0.0
    k = w.constants
    roles = {ROLE[t] for t in tasks}
    trained = {ROLE[t] for t in tasks if KIND[t] == "train"}
    return sum(w.model(r).params * k.weight_bytes for r in roles) + sum(
        w.model(r).params * k.optimizer_bytes for r in trained
    )


def parked_per_device(total: float, memory: np.ndarray) -> np.ndarray:
    """``total`` spread over devices in proportion to their memory."""
    return total * memory / memory.sum() if total > 0 else np.zeros_like(memory)


def weight_shard(model: ModelSize, w: Workload, layout: Layout) -> float:
    return model.params * w.constants.weight_bytes / (layout.pp * layout.tp)


def kv_per_sequence(model: ModelSize, w: Workload, tp: int) -> float:
    """KV bytes one full-length sequence holds on one tensor rank."""
    return model.kv_bytes_per_token(w.constants.kv_bytes) * w.seq_len / tp


def inference_stage_bytes(model: ModelSize, w: Workload, layout: Layout) -> np.ndarray:
    """(pp,) bytes on each device of each stage while running inference."""
    k = w.constants
    tokens = w.micro_batch * w.seq_len
    base = weight_shard(model, w, layout) + k.layer_work_bytes_per_token * tokens * model.hidden / layout.tp
    out = np.full(layout.pp, base)
    out[-1] += tokens * model.vocab * k.logit_bytes / layout.tp
    return out


def training_stage_bytes(model: ModelSize, w: Workload, layout: Layout, optimizer_local: bool) -> np.ndarray:
    """(pp,) bytes on each device of each stage while training (1F1B in-flight micro-batches)."""
    k = w.constants
    pp, tp = layout.pp, layout.tp
    tokens = w.micro_batch * w.seq_len
    per_replica = w.sequences / layout.dp / w.optimizer_steps
    micro = max(1, int(np.ceil(per_replica / w.micro_batch)))
    inflight = np.minimum(micro, pp - np.arange(pp))
    stage_layers = model.layers / pp
    if k.recompute:
        ckpt = tokens * stage_layers * model.hidden * k.activation_bytes
    else:
        ckpt = k.layer_work_bytes_per_token * tokens * stage_layers * model.hidden / tp
    state = model.params * (k.weight_bytes + k.grad_bytes) / (pp * tp)
    if optimizer_local:
        state += model.params * k.optimizer_bytes / (pp * tp * layout.dp)
    work = k.layer_work_bytes_per_token * tokens * model.hidden / tp
    out = state + inflight * ckpt + work
    out[-1] += 2.0 * tokens * model.vocab * k.logit_bytes / tp
    return out


def fsdp_bytes(model: ModelSize, w: Workload, n: int, train: bool) -> float:
    """Bytes on each device of a ZeRO-3 shard group of ``n`` while a task runs, beyond the parked shards."""
    k = w.constants
    gathered = 2.0 * model.params * k.weight_bytes / model.layers
    flat = Layout(n, 1, 1)
    if not train:
        return float(inference_stage_bytes(model, w, flat)[0]) - weight_shard(model, w, flat) + gathered
    replicated = model.params * (k.weight_bytes + k.grad_bytes)
    active = float(training_stage_bytes(model, w, flat, optimizer_local=False)[0]) - replicated
    return active + gathered + model.params * k.grad_bytes / n
