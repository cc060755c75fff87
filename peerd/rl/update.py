"""One iteration's GRPO updates: shared by the single-process trainer and the swarm's learner.

Given the iteration's groups packed as one batch (``pack``), the reference's log-probs of its
tokens and each completion's reward: group-relative advantages, then ``epochs`` passes over
``parts`` (contiguous ranges of groups), one optimizer step per part (zero, backward, clip the
global norm, step, then ``after_step``: e.g. the LR schedule). The figures are those of the first
pass, each update weighted by its share of the groups: the rollouts as they came, before any
update on them (later passes are off-policy, held by the clip).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from peerd.models.gpt import GPT
from peerd.rl.loss import GRPOLossConfig, group_advantages, grpo_loss
from peerd.rl.rollout import PackedBatch, token_logprobs


@dataclass(frozen=True)
class UpdateFigures:
    loss: float
    """GRPO loss of the first pass, weighted by each update's share of the groups."""
    kl: float
    """Mean k3 KL to the reference over the first pass (before any update of this iteration)."""
    clip_fraction: float
    """Share of completion tokens clipped, averaged over every update."""
    updates: int


def frozen_copy(model: GPT) -> GPT:
    """A copy of ``model`` in eval mode whose parameters take no gradient (the KL reference)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def grpo_updates(
    policy: GPT,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    ref_BT: torch.Tensor,
    rewards: Sequence[Sequence[float]],
    parts: Sequence[range],
    *,
    group_size: int,
    epochs: int,
    temperature: float,
    loss: GRPOLossConfig,
    grad_clip: float | None,
    after_step: Callable[[], object] | None = None,
) -> UpdateFigures:
    """Train ``policy`` on ``batch`` (rows laid out group by group, ``group_size`` each); see the module."""
    groups = sum(len(p) for p in parts)
    adv_B = group_advantages(torch.tensor(rewards), loss.adv_eps).reshape(-1).to(batch.tokens_BT.device)
    kl = loss_sum = clip = 0.0
    policy.train()
    for k, part in enumerate(list(parts) * epochs):
        rows = slice(part.start * group_size, part.stop * group_size)
        logp_BT = token_logprobs(policy, batch.tokens_BT[rows], temperature)
        out = grpo_loss(
            logp_BT, batch.old_logp_BT[rows], ref_BT[rows], adv_B[rows], batch.mask_BT[rows], loss
        )
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step()
        if k < len(parts):
            share = len(part) / groups
            kl, loss_sum = kl + share * out.kl, loss_sum + share * out.loss.item()
        clip += out.clip_fraction / (len(parts) * epochs)
    return UpdateFigures(loss=loss_sum, kl=kl, clip_fraction=clip, updates=len(parts) * epochs)
