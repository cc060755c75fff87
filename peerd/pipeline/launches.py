"""What one micro-batch's forward and backward through each layer of a pipeline job dispatches, counted on the stage's own code.

The ``peerd`` cost model prices a stage's compute by its FLOPs at the device's measured matmul
rate. A small model does not fill a device: its ops' dispatch, the memory traffic of everything
that is not a matmul's weights, and a few slow kinds of op (``peerd.models.launches``) cost more
than its arithmetic. On this machine a width-128 block's micro-batch of 2 x 64 tokens took 1.9 ms
on one thread, which its FLOPs price at 0.75 ms. ``count_layer_work`` gives the model the units
it prices those with: per layer, the ops (``OpCounter.ops``), the bytes they read and write beyond
the layer's weights, and the units of each ``ELEMENT_FAMILIES`` family, for one micro-batch of the
job, forward and backward, as a stage worker runs it (a leaf input that takes a gradient, the
family's loss on the last layer), in fp32 (a bf16 or fp16 job's casts are not counted).

With the job's optimizer, each layer's update is counted too: what a stage worker's update does
once per step over the layer's parameters (``StageWorker._apply``: the rollback copy of the state,
``take_snapshot``; the clipping scale and the norm's sum of squares when the job clips; the
optimizer's and the LR schedule's steps), every byte it reads and writes, weights included.

The counts run on narrow copies of the layers: the same ops at 2, 4 and 6 dims per head. Every
tensor a layer reads or writes has a size of degree at most two in the width (activations, the
MLP's 4x width, the weights' gradients), so the three counts give the real width's bytes and
units exactly (a quadratic through them); the ops do not depend on the width. Layers of one class
with the same parameter shapes (a GPT's blocks) are counted once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from peerd.models.launches import ELEMENT_FAMILIES, OpCounter
from peerd.models.registry import GPTFamily, ModelFamily
from peerd.pipeline.optim import OptimizerConfig, build_optimizer, build_scheduler, squared_norm
from peerd.pipeline.worker import take_snapshot
from peerd.sched.elements import PerFamily
from peerd.sched.scenario import LayerWork

NARROW_HEAD_DIMS = (2, 4, 6)
"""Dims per head of the copies counted; three points fix a quadratic in the width."""

MAX_LOGITS = 1 << 24
"""Most logits (micro-batch x seq x vocabulary) a count may build: beyond it the head's count would
need gigabytes, and such a model's arithmetic outweighs what is counted here; it is priced by FLOPs."""


def narrowed(family: ModelFamily, head_dim: int) -> ModelFamily | None:
    """``family`` at ``head_dim`` dims per head (the MLP keeps its ratio to the width); None for a
    family this module cannot narrow (its layers are then priced by FLOPs alone)."""
    if not isinstance(family, GPTFamily):
        return None
    cfg = family.cfg
    width = cfg.n_head * head_dim
    ff = None if cfg.d_ff is None else max(1, round(cfg.d_ff * width / cfg.d_model))
    return GPTFamily(dataclasses.replace(cfg, d_model=width, d_ff=ff), family.seed)


def count_layer_work(
    family: ModelFamily, micro_batch: int, seq: int, optimizer: OptimizerConfig | None = None
) -> list[LayerWork] | None:
    """Per layer of ``family``, the work of one micro-batch of ``micro_batch`` sequences of ``seq``
    tokens and, with ``optimizer``, of its optimizer step (see the module docstring); None when the
    family cannot be narrowed or the head's logits would exceed ``MAX_LOGITS``."""
    if micro_batch * seq * family.vocab_size > MAX_LOGITS:
        return None
    copies = [narrowed(family, d) for d in NARROW_HEAD_DIMS]
    if any(c is None for c in copies):
        return None
    widths = np.array([c.hidden for c in copies if c is not None], dtype=float)
    out: list[LayerWork] = []
    seen: dict[tuple, LayerWork] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for index in range(family.num_layers):
            first = _count(copies[0], index, micro_batch, seq, optimizer)  # type: ignore[arg-type]
            key = (index == 0, index == family.num_layers - 1, first.signature)
            if key not in seen:
                rest = [_count(c, index, micro_batch, seq, optimizer) for c in copies[1:] if c is not None]
                seen[key] = _fit(widths, family.hidden, [first, *rest])
            out.append(seen[key])
    return out


class _Counted(NamedTuple):
    ops: int
    traffic: int
    elements: dict[str, int]
    update_ops: int
    update_traffic: int
    signature: tuple


def _count(
    family: ModelFamily, index: int, micro_batch: int, seq: int, optimizer: OptimizerConfig | None = None
) -> _Counted:
    """One layer's micro-batch (ops, bytes beyond the weights, element units) and optimizer step."""
    layer = family.build_layer(index)
    weights = list(layer.parameters())
    last = index == family.num_layers - 1
    if index == 0:
        x = torch.randint(0, family.vocab_size, (micro_batch, seq))
    else:
        x = torch.randn(micro_batch, seq, family.hidden).requires_grad_(True)
    targets = torch.randint(0, family.vocab_size, (micro_batch, seq)) if last else None
    with OpCounter(exclude=weights) as counter:
        y = layer(x)
        if targets is not None:
            family.loss(y, targets).backward()
        else:
            y.backward(torch.ones_like(y))
    update_ops, update_traffic = _count_update(layer, optimizer) if optimizer is not None else (0, 0)
    return _Counted(
        counter.ops, counter.bytes, dict(counter.elements), update_ops, update_traffic, _signature(layer)
    )


def _count_update(layer: nn.Module, cfg: OptimizerConfig) -> tuple[int, int]:
    """(ops, bytes) of a stage worker's update of ``layer`` (its gradients in place): the rollback
    copy, the clipping scale and the optimizer and LR-schedule steps, after a first step has built
    the optimizer's state. The gradient norm's sum of squares is counted with it when the job clips."""
    params = [p for p in layer.parameters() if p.grad is not None]
    optimizer = build_optimizer(params, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=2)
    optimizer.step()
    scheduler.step()
    with OpCounter() as counter:
        take_snapshot(1, layer, optimizer, scheduler)
        if cfg.grad_clip is not None:
            squared_norm([p.grad for p in params if p.grad is not None])
            for p in params:
                assert p.grad is not None
                p.grad.mul_(1.0)
        optimizer.step()
        scheduler.step()
    return counter.ops, counter.bytes


def _signature(layer: nn.Module) -> tuple:
    """A layer's class and parameter shapes, normalised by the width (identical blocks agree)."""
    return (type(layer).__name__, tuple(p.dim() for p in layer.parameters()))


def _fit(widths: np.ndarray, width: int, counts: list[_Counted]) -> LayerWork:
    """The work at ``width`` from the counts at ``widths``: bytes and units on the quadratic through
    them, the ops (the same at every width) as counted at the widest copy."""

    def at_width(values: list[float]) -> float:
        coeffs = np.polyfit(widths, np.array(values, dtype=float), 2)
        return float(max(0, round(float(np.polyval(coeffs, width)))))  # counts are whole numbers

    widest = counts[-1]
    return LayerWork(
        ops=float(widest.ops),
        traffic_bytes=at_width([c.traffic for c in counts]),
        elements=PerFamily(*(at_width([c.elements[f] for c in counts]) for f in ELEMENT_FAMILIES)),
        update_ops=float(widest.update_ops),
        update_traffic_bytes=at_width([c.update_traffic for c in counts]),
    )
