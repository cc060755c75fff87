"""The starting policy: a short supervised warm-up on the task's format, teacher-forced on correct answers.

GRPO learns only from differences within a group: a policy that never emits a well-formed,
correct answer gets all-equal rewards and zero advantages. A few hundred steps of next-token
cross entropy on ``prompt + answer + END`` (loss on the answer tokens only, the prompt is given)
teach the format and part of the skill, so RL starts from a non-zero pass rate.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.nn.functional as F

from peerd.loading import Range, check, problems
from peerd.log import get_logger
from peerd.models.gpt import GPT
from peerd.rl.rollout import layout
from peerd.rl.tasks import Task

log = get_logger(__name__)


@dataclass
class WarmupConfig:
    """The supervised warm-up before GRPO."""

    steps: Annotated[int, Range(ge=0, le=2**31 - 1)] = 300
    """Optimizer steps; 0 starts GRPO from the given weights."""
    batch_size: Annotated[int, Range(ge=1, le=1 << 16)] = 64
    """Problems per step (fresh ones every step)."""
    lr: Annotated[float, Range(gt=0, lt=10)] = 3e-3
    """AdamW learning rate (constant)."""
    seed: Annotated[int, Range(ge=0, lt=2**63)] = 0  # random.Random takes any int; a record is bounded
    """Seeds the problem stream (independent of the GRPO run's)."""


@dataclass
class WarmupResult:
    losses: list[float] = field(default_factory=list)
    """Answer-token cross entropy of each step."""
    seconds: float = 0.0


def answer_loss(model: GPT, task_problems: list, device: torch.device) -> torch.Tensor:
    """Mean cross entropy of the answer tokens (end marker included) given the prompts."""
    tokens_BT, mask_BT = layout(
        [p.prompt_ids for p in task_problems], [p.target_ids for p in task_problems], device
    )
    logits_BTV = model(tokens_BT[:, :-1]).float()
    nll_BT = F.cross_entropy(logits_BTV.transpose(1, 2), tokens_BT[:, 1:], reduction="none")
    return (nll_BT * mask_BT).sum() / mask_BT.sum()


def supervised_warmup(model: GPT, task: Task, cfg: WarmupConfig) -> WarmupResult:
    """Train ``model`` in place on correct answers of ``task``."""
    check(problems(cfg, "warmup"), "the warm-up")
    result = WarmupResult()
    if cfg.steps == 0:
        return result
    device = next(model.parameters()).device
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        loss = answer_loss(model, [task.sample(rng) for _ in range(cfg.batch_size)], device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(loss.item())
    result.seconds = time.perf_counter() - t0
    log.info(
        "warm-up: %d steps, loss %.3f -> %.3f in %.1f s",
        cfg.steps,
        result.losses[0],
        result.losses[-1],
        result.seconds,
    )
    return result
