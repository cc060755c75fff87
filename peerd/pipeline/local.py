"""Single-process reference executor: a partitioned model run through a micro-batch schedule.

This is the exactness reference for multi-peer training: it executes the same per-stage action
lists as the stage workers (in ``simulate``'s dependency order), passes activations and gradients
between stages through a ``BoundaryHook`` (identity by default; a codec plugs in here), accumulates
gradients over micro-batches, and optionally emulates ``R`` data-parallel replicas whose
per-stage gradients are combined by a ``GradientReducer`` (mean by default; gradient compression
with error feedback plugs in here). The optimizer, LR schedule and clipping come from
``peerd.pipeline.optim``; clipping is the workers' own arithmetic over the whole model (float64
sums of squares per stage, added up the pipeline from the last stage, one coefficient): torch's
``clip_grad_norm_`` takes a float32 norm of per-tensor norms, which differs in the last bits,
and over hundreds of steps those bits grow into visibly different curves (1e-4 by step ~50, 5 %
by step 600 on the churn job). With identity hooks and fp32 it reproduces unstaged full-batch
training (torch's clipping) up to float rounding. ``precision`` (``bf16`` / ``fp16``) runs
forward passes under the same autocast as the workers (``peerd.pipeline.precision``) and casts
what crosses a boundary to float32, as the wire does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from peerd.data.dataset import WindowDataset
from peerd.data.sampler import EpochSampler, micro_batches
from peerd.models.gpt import lm_loss
from peerd.pipeline.optim import (
    OptimizerConfig,
    build_optimizer,
    build_scheduler,
    clip_coefficient,
    seek_schedule,
    squared_norm,
    with_shorthands,
)
from peerd.pipeline.partition import StageModule, model_layers, partition
from peerd.pipeline.precision import StagePrecision
from peerd.pipeline.schedule import Op, Schedule, get_schedule, simulate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits (B,T,V), targets (B,T)) -> mean


class BoundaryHook(Protocol):
    """What crosses stage boundary ``boundary`` (between stage ``boundary`` and ``boundary + 1``).

    Each method gets the sender's tensor and returns what the receiver will see (e.g. the codec's
    decode(encode(x))). ``example_ids`` are the micro-batch's stable ids, row order.
    """

    def activations(
        self, boundary: int, example_ids: Sequence[int], acts_BTC: torch.Tensor
    ) -> torch.Tensor: ...

    def gradients(
        self, boundary: int, example_ids: Sequence[int], grads_BTC: torch.Tensor
    ) -> torch.Tensor: ...


class IdentityHook:
    """No compression: the receiver sees exactly what was sent."""

    def activations(self, boundary: int, example_ids: Sequence[int], acts_BTC: torch.Tensor) -> torch.Tensor:
        return acts_BTC

    def gradients(self, boundary: int, example_ids: Sequence[int], grads_BTC: torch.Tensor) -> torch.Tensor:
        return grads_BTC


class GradientReducer(Protocol):
    """Combine stage ``stage``'s gradients from each replica (``grads[r][k]`` = replica r, k-th param)."""

    def reduce(self, stage: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]: ...


class MeanReducer:
    """Exact all-reduce: the plain mean over replicas."""

    def reduce(self, stage: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.stack(per_param).mean(dim=0) for per_param in zip(*grads, strict=True)]


@dataclass(frozen=True)
class MicroBatch:
    ids: list[int]
    inputs: torch.Tensor  # (b, T) int64 tokens
    targets: torch.Tensor  # (b, T) int64


@dataclass
class PassStats:
    loss_sum: float = 0.0  # sum over micro-batches of weight * loss
    peak_live: list[int] = field(default_factory=list)  # per stage: most micro-batches whose graph was held


class LocalPipeline:
    """Runs stages (in one process) through a schedule; stage ``s`` must hold layers after stage ``s-1``."""

    def __init__(
        self,
        stages: Sequence[StageModule],
        schedule: Schedule | str = "1f1b",
        hook: BoundaryHook | None = None,
        loss_fn: LossFn | None = None,
        precision: StagePrecision | None = None,
    ) -> None:
        assert stages and stages[0].is_first and stages[-1].is_last, "stages must cover the model in order"
        self.stages = list(stages)
        self.schedule = get_schedule(schedule) if isinstance(schedule, str) else schedule
        self.hook: BoundaryHook = hook or IdentityHook()
        self.loss_fn = loss_fn or lm_loss
        self.precision = precision or StagePrecision("fp32")

    def forward_backward(self, micro: Sequence[MicroBatch], weight_total: int | None = None) -> PassStats:
        """Forward and backward every micro-batch; gradients accumulate into ``.grad``.

        Micro-batch ``i``'s loss is weighted by its share of ``weight_total`` target tokens (default:
        all of ``micro``), so the accumulated gradient is that of the mean loss over the whole batch.
        """
        S, M = len(self.stages), len(micro)
        total = weight_total if weight_total is not None else sum(mb.targets.numel() for mb in micro)
        order = simulate(self.schedule, S, M).events
        stage_in: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> input leaf (stages > 0)
        stage_out: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output, or weighted loss
        act_box: dict[tuple[int, int], torch.Tensor] = {}  # sent, not yet received
        grad_box: dict[tuple[int, int], torch.Tensor] = {}
        out_grad: dict[tuple[int, int], torch.Tensor] = {}
        stats = PassStats(peak_live=[0] * S)
        for s, action in order:
            i, mb = action.mb, micro[action.mb]
            key = (s, i)
            if action.op is Op.RECV_ACT:
                stage_in[key] = act_box.pop(key).detach().requires_grad_(True)
            elif action.op is Op.FORWARD:
                x = mb.inputs if s == 0 else stage_in[key]
                with self.precision.autocast():
                    y = self.stages[s](x)
                    if s == S - 1:
                        loss = self.loss_fn(y, mb.targets)
                if s == S - 1:
                    stats.loss_sum += loss.item() * mb.targets.numel() / total
                    y = loss.float() * (mb.targets.numel() / total)
                stage_out[key] = y
                live = sum(1 for (t, _) in stage_out if t == s)
                stats.peak_live[s] = max(stats.peak_live[s], live)
            elif action.op is Op.SEND_ACT:
                # float32, as on the wire, whatever autocast computed in
                act_box[(s + 1, i)] = self.hook.activations(s, mb.ids, stage_out[key].detach().float())
            elif action.op is Op.RECV_GRAD:
                out_grad[key] = grad_box.pop(key)
            elif action.op is Op.BACKWARD:
                y = stage_out.pop(key)
                if s == S - 1:
                    self.precision.scale(y).backward()
                else:
                    y.backward(out_grad.pop(key))
            elif action.op is Op.SEND_GRAD:
                x = stage_in.pop(key)
                assert x.grad is not None, "stage input got no gradient"
                grad_box[(s - 1, i)] = self.hook.gradients(s - 1, mb.ids, x.grad)
        assert not (stage_out or act_box or grad_box or out_grad), "schedule left work undone"
        return stats


def stage_parameters(stages: Sequence[StageModule]) -> list[list[torch.nn.Parameter]]:
    """Each stage's trainable parameters; a tensor shared by several stages is listed under the first."""
    seen: set[int] = set()
    out = []
    for stage in stages:
        params = [p for p in stage.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append(params)
    return out


@dataclass(frozen=True)
class LocalRunConfig:
    """A reference training run: what to train on and how to split it."""

    steps: int
    global_batch: int
    micro_batch_size: int
    layers_per_stage: list[int] | None = None  # None: one stage holding every layer
    replicas: int = 1
    schedule: str = "1f1b"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: float | None = None  # shorthand for optimizer.lr (folded in when built)
    weight_decay: float | None = None  # shorthand for optimizer.weight_decay (folded in when built)
    data_seed: int = 0
    start_step: int = 0
    total_steps: int | None = None  # the LR schedule's horizon; None: start_step + steps
    precision: str = "fp32"  # fp32, bf16 or fp16 autocast (peerd.pipeline.precision)

    def __post_init__(self) -> None:
        if self.lr is not None or self.weight_decay is not None:
            object.__setattr__(self, "optimizer", with_shorthands(self.optimizer, self.lr, self.weight_decay))
            object.__setattr__(self, "lr", None)
            object.__setattr__(self, "weight_decay", None)

    @property
    def horizon(self) -> int:
        return self.total_steps if self.total_steps is not None else self.start_step + self.steps


def optimizer_and_scheduler(
    params: Sequence[torch.nn.Parameter],
    cfg: LocalRunConfig,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LambdaLR | None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The given ones, or new ones; a new scheduler on a given optimizer starts at ``cfg.start_step``."""
    optimizer = optimizer or build_optimizer(params, cfg.optimizer)
    if scheduler is None:
        # LambdaLR keeps a group's "initial_lr" if an earlier scheduler set it: the peak lr either way
        scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.horizon)
        seek_schedule(scheduler, cfg.start_step)
    return optimizer, scheduler


def micro_batches_of(dataset: WindowDataset, ids: Sequence[int], micro_batch_size: int) -> list[MicroBatch]:
    out = []
    for chunk in micro_batches(ids, micro_batch_size):
        x, y = dataset.batch(chunk)
        out.append(MicroBatch(chunk, x, y))
    return out


def train_pipelined(
    model: torch.nn.Module,
    dataset: WindowDataset,
    cfg: LocalRunConfig,
    hook: BoundaryHook | None = None,
    reducer: GradientReducer | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None,
) -> list[float]:
    """Train ``model`` split into stages for ``cfg.steps`` steps; returns the loss of every step.

    Each replica runs its shard of the step's batch through the pipeline; each stage's gradients
    are then combined across replicas by ``reducer``, clipped to the model-wide norm, and one
    optimizer step is taken. Pass the ``optimizer`` (and ``scheduler``) back in to continue a run
    (their state is part of the curve).
    """
    layers = model_layers(model)
    split = cfg.layers_per_stage or [len(layers)]
    stages = partition(model, split)
    precision = StagePrecision(cfg.precision, next(model.parameters()).device)
    pipe = LocalPipeline(stages, cfg.schedule, hook, precision=precision)
    params = stage_parameters(stages)
    reducer = reducer or MeanReducer()
    flat = [p for ps in params for p in ps]
    optimizer, scheduler = optimizer_and_scheduler(flat, cfg, optimizer, scheduler)
    sampler = EpochSampler(len(dataset), cfg.global_batch, cfg.data_seed, cfg.replicas)
    losses = []
    for step in range(cfg.start_step, cfg.start_step + cfg.steps):
        per_replica: list[list[list[tuple[torch.Tensor, bool]]]] = []  # [replica][stage][param]
        loss = 0.0
        for r in range(cfg.replicas):
            optimizer.zero_grad(set_to_none=True)
            micro = micro_batches_of(dataset, sampler.replica_ids(step, r), cfg.micro_batch_size)
            loss += pipe.forward_backward(micro).loss_sum / cfg.replicas
            per_replica.append([[_grad_or_zero(p) for p in ps] for ps in params])
        for s, ps in enumerate(params):
            reduced = reducer.reduce(s, [[g for g, _ in grads[s]] for grads in per_replica])
            for k, (p, g) in enumerate(zip(ps, reduced, strict=True)):
                # Untouched by every replica: leave it gradient-less, as plain training would.
                p.grad = g if any(grads[s][k][1] for grads in per_replica) else None
        # fp16: clip the true gradients; an overflow anywhere skips the step of every stage
        finite = precision.unscale(flat)
        if finite:
            _clip_across_stages(params, cfg.optimizer.grad_clip)
        precision.step(optimizer, overflowed=not finite)
        precision.step_schedule(scheduler)
        losses.append(loss)
    return losses


def train_unstaged(
    model: torch.nn.Module,
    dataset: WindowDataset,
    cfg: LocalRunConfig,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None,
) -> list[float]:
    """Plain full-batch training (no stages, no micro-batches): what ``train_pipelined`` must match."""
    params = list(model.parameters())
    optimizer, scheduler = optimizer_and_scheduler(params, cfg, optimizer, scheduler)
    sampler = EpochSampler(len(dataset), cfg.global_batch, cfg.data_seed, cfg.replicas)
    losses = []
    for step in range(cfg.start_step, cfg.start_step + cfg.steps):
        x_BT, y_BT = dataset.batch(sampler.batch_ids(step))
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x_BT), y_BT)
        loss.backward()
        _step(params, cfg.optimizer, optimizer, scheduler)
        losses.append(loss.item())
    return losses


def _step(
    params: Sequence[torch.nn.Parameter],
    cfg: OptimizerConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    precision: StagePrecision | None = None,
) -> None:
    precision = precision or StagePrecision("fp32")
    finite = precision.unscale(list(params))  # fp16: clip the true gradients
    if cfg.grad_clip is not None and finite:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    precision.step(optimizer, overflowed=not finite)
    precision.step_schedule(scheduler)


def _clip_across_stages(params: Sequence[Sequence[torch.nn.Parameter]], max_norm: float | None) -> None:
    """Scale every gradient as the stage workers do: one coefficient from the replica's total norm.

    Stage ``s`` adds its float64 sum of squares to the partial sum of the stages below it
    (``StageWorker._replica_squared_norm``), so the total is ``p0 + (p1 + (... + p_last))``.
    """
    if max_norm is None:
        return
    total = 0.0
    for ps in reversed(params):
        total = squared_norm([p.grad for p in ps if p.grad is not None]) + total
    scale = clip_coefficient(total, max_norm)
    if scale != 1.0:
        for ps in params:
            for p in ps:
                if p.grad is not None:
                    p.grad.mul_(scale)


def _grad_or_zero(p: torch.nn.Parameter) -> tuple[torch.Tensor, bool]:
    """(gradient or zeros, whether backward reached ``p`` at all)."""
    if p.grad is None:
        return torch.zeros_like(p), False
    return p.grad.detach().clone(), True
