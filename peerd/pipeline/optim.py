"""The optimizer a pipeline job trains with: AdamW/Adam/SGD, warm-up + decay schedule, global-norm clipping.

One ``OptimizerConfig`` builds the torch optimizer and its LR scheduler for both the
single-process reference (``peerd.pipeline.local``) and every stage worker, so their curves
are comparable step for step. The schedule is a pure function of the step (``lr_factor``):
linear warm-up over ``warmup_steps`` to the peak ``lr``, then ``cosine``/``linear`` decay to
``min_lr_ratio × lr`` at the job's last step, or ``constant``.

Clipping by the global norm of a replica's gradient needs every stage's share, and a stage
only talks to its pipeline neighbours. After gradient averaging each stage computes the sum
of squares of its (averaged) gradients; the partial sums travel upstream on the pipeline
streams (``pp.norm`` frames, micro-batch ``NORM_PARTIAL``: stage ``S-1`` sends its own, stage
``s`` adds its own to what came from ``s+1``), stage 0 then holds the total and sends it back
downstream unchanged (``NORM_TOTAL``), so every stage scales by the same coefficient
``min(1, grad_clip / (norm + 1e-6))`` (torch's ``clip_grad_norm_``). Replicas of a stage hold
identical averaged gradients, so they compute identical totals and stay in step. Cost: 2(S-1)
one-hop messages of 8 payload bytes per step, and their latency on the step's critical path.
Under fp16 the same exchange carries the loss scale's overflow verdict (``OVERFLOWED`` in place
of a sum), also without clipping, so every stage skips the same steps.
Wire format: protocols/pipeline-norm.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from peerd.errors import ConfigError

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
NORM_PARTIAL = 0  # pp.norm micro-batch index: a partial sum of squares going upstream
NORM_TOTAL = 1  # pp.norm micro-batch index: the replica's total sum of squares going downstream
# What a stage sends instead of a sum of squares when its fp16 gradients overflowed (a sum of
# squares is never negative): it absorbs every sum, so every stage learns to skip the step.
OVERFLOWED = -1.0


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule and gradient clipping of a training run."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """``torch.optim.AdamW``, ``Adam`` (L2 weight decay in the gradient) or ``SGD``."""
    lr: float = 1e-3
    """Peak learning rate (reached at the end of warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator term."""
    momentum: float = 0.0
    """SGD momentum (0: plain SGD)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) or L2 (Adam, SGD) weight decay."""
    warmup_steps: int = 0
    """Steps of linear warm-up: step ``s < warmup_steps`` runs at ``lr × (s + 1) / warmup_steps``."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: stay at ``lr``, or decay (cosine / linear) to ``min_lr_ratio × lr`` at the last step."""
    min_lr_ratio: float = 0.0
    """Final learning rate of a decaying schedule, as a fraction of ``lr``."""
    grad_clip: float | None = None
    """Clip the gradient to this global L2 norm (over all stages of a replica); None: no clipping."""

    def validate(self) -> None:
        if self.name not in ("adamw", "adam", "sgd"):
            raise ConfigError("optimizer.name", f"unknown {self.name!r} (known: adamw, adam, sgd)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("optimizer.lr", f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("optimizer.betas", f"two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ConfigError("optimizer.eps", f"must be > 0, got {self.eps}")
        if not 0 <= self.momentum < 1:
            raise ConfigError("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if not self.weight_decay >= 0:
            raise ConfigError("optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(
                "optimizer.schedule", f"unknown {self.schedule!r} (known: constant, cosine, linear)"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optimizer.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ConfigError("optimizer.grad_clip", f"must be > 0 (or null), got {self.grad_clip}")


def with_shorthands(cfg: OptimizerConfig, lr: float | None, weight_decay: float | None) -> OptimizerConfig:
    """``cfg`` with the configs' ``lr`` / ``weight_decay`` shorthands (where given) folded in."""
    return dataclasses.replace(
        cfg,
        lr=cfg.lr if lr is None else lr,
        weight_decay=cfg.weight_decay if weight_decay is None else weight_decay,
    )


def lr_factor(cfg: OptimizerConfig, step: int, total_steps: int) -> float:
    """The multiple of ``cfg.lr`` that the update of step ``step`` (0-based) of ``total_steps`` uses."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - cfg.warmup_steps)  # the last step reaches min_lr_ratio exactly
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer of ``cfg`` over ``params`` (at the peak lr; the scheduler scales it)."""
    cfg.validate()
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Sets the lr of step 0 now; each ``scheduler.step()`` after an optimizer step sets the next one's."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, total_steps))


def seek_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put ``scheduler`` (and its optimizer's lr) at ``step``: for a saved state that lacks the scheduler's."""
    scheduler.last_epoch = step
    for group, base, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]  # what get_last_lr reports


def squared_norm(grads: Sequence[torch.Tensor]) -> float:
    """Sum of squares of every element of ``grads`` (float64: it is summed across stages)."""
    return math.fsum(float(torch.linalg.vector_norm(g.detach(), 2).double() ** 2) for g in grads)


def add_partial_norms(own: float, below: float) -> float:
    """A stage's partial sum of squares plus the one from the stages below it; ``OVERFLOWED`` absorbs."""
    return OVERFLOWED if OVERFLOWED in (own, below) else own + below


def clip_coefficient(total_squared_norm: float, max_norm: float | None) -> float:
    """The factor every gradient of the replica is scaled by (1.0: no clipping needed or configured)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_squared_norm) + CLIP_EPS))
