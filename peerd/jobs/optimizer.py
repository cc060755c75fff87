"""A job spec's optimizer section as the runtime builds it."""

from __future__ import annotations

from peerd.jobs.spec import OptimizerSpec
from peerd.pipeline.optim import OptimizerConfig


def optimizer_config(opt: OptimizerSpec) -> OptimizerConfig:
    """The spec's optimizer section as the stage workers and the rl trainer run it (the spec's
    documented defaults filled in)."""
    return OptimizerConfig(
        name=opt.name,
        lr=opt.lr,
        betas=opt.betas if opt.betas is not None else (0.9, 0.95),
        momentum=opt.momentum if opt.momentum is not None else 0.0,
        weight_decay=opt.weight_decay,
        warmup_steps=opt.warmup_steps,
        schedule=opt.schedule,
        min_lr_ratio=opt.min_lr_ratio,
        grad_clip=opt.grad_clip,
    )
