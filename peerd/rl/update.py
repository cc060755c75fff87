"""One iteration's GRPO updates: shared by the single-process trainer and the swarm's learner.

Given the iteration's groups packed as one batch (``pack``), the reference's log-probs of its
tokens and each completion's reward: group-relative advantages, then ``epochs`` passes over
``parts``, one optimizer step per part (zero, backward, clip the global norm, step, then
``after_step``: e.g. the LR schedule). The figures are those of the first pass, each update
weighted by its groups: the rollouts as they came, before any update on them (later passes are
off-policy, held by the clip).

A part is one range of groups per data-parallel replica. With one range and no ``average`` it
is a plain update on that range's mean loss. Otherwise the update's gradient is the mean over
replicas of each replica's mean-loss gradient, weighted by its groups (a replica whose share of
the update is short, or empty, weighs less): ``average`` is the data-parallel group's mean
(``peerd.averaging``) when each process holds one replica; the single-process reference passes
every replica's range and no ``average``, which is the same arithmetic in one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from peerd.models.gpt import GPT
from peerd.rl.loss import GRPOLossConfig, LossParts, group_advantages, grpo_loss
from peerd.rl.rollout import PackedBatch, token_logprobs


class Average(Protocol):
    """The mean of each tensor over a data-parallel group, identical on every member.

    ``exact``: how many of the trailing tensors must come back exact (counts, figures, weights): a
    group that compresses gradients averages them apart, losslessly; the others may come back
    quantized (with error feedback).
    """

    def __call__(self, tensors: list[torch.Tensor], exact: int = 0) -> list[torch.Tensor]: ...


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
    parts: Sequence[Sequence[range]],
    *,
    group_size: int,
    epochs: int,
    temperature: float,
    loss: GRPOLossConfig,
    grad_clip: float | None,
    after_step: Callable[[], object] | None = None,
    average: Average | None = None,
) -> UpdateFigures:
    """Train ``policy`` on ``batch`` (rows laid out group by group, ``group_size`` each); see the module."""
    adv_B = torch.zeros(0, device=batch.tokens_BT.device)  # a data-parallel replica may hold no group
    if len(rewards):
        adv_B = group_advantages(torch.tensor(rewards), loss.adv_eps).reshape(-1).to(adv_B.device)
    params = [p for p in policy.parameters() if p.requires_grad]
    kl = loss_sum = clip = weight = 0.0
    policy.train()
    for k, part in enumerate(list(parts) * epochs):
        optimizer.zero_grad(set_to_none=True)
        if average is None and len(part) == 1:  # one replica's mean loss: its gradient as it is
            out = _part_loss(policy, batch, ref_BT, adv_B, part[0], group_size, temperature, loss)
            out.loss.backward()
            groups, figures = float(len(part[0])), (out.loss.item(), out.kl, out.clip_fraction)
        else:
            groups, figures = _replicas_backward(
                policy, params, batch, ref_BT, adv_B, part, group_size, temperature, loss, average
            )
        if groups > 0:
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
            optimizer.step()
        if after_step is not None:
            after_step()  # skipped or not, every replica's schedule stays on the same update
        if k < len(parts):
            weight += groups
            loss_sum, kl = loss_sum + groups * figures[0], kl + groups * figures[1]
        clip += figures[2] / (len(parts) * epochs)
    weight = max(weight, 1e-30)
    return UpdateFigures(
        loss=loss_sum / weight, kl=kl / weight, clip_fraction=clip, updates=len(parts) * epochs
    )


def _part_loss(
    policy: GPT,
    batch: PackedBatch,
    ref_BT: torch.Tensor,
    adv_B: torch.Tensor,
    groups: range,
    group_size: int,
    temperature: float,
    loss: GRPOLossConfig,
) -> LossParts:
    rows = slice(groups.start * group_size, groups.stop * group_size)
    logp_BT = token_logprobs(policy, batch.tokens_BT[rows], temperature)
    return grpo_loss(logp_BT, batch.old_logp_BT[rows], ref_BT[rows], adv_B[rows], batch.mask_BT[rows], loss)


def _replicas_backward(
    policy: GPT,
    params: list[torch.nn.Parameter],
    batch: PackedBatch,
    ref_BT: torch.Tensor,
    adv_B: torch.Tensor,
    part: Sequence[range],
    group_size: int,
    temperature: float,
    loss: GRPOLossConfig,
    average: Average | None,
) -> tuple[float, tuple[float, float, float]]:
    """Leave in ``.grad`` the group-weighted mean over replicas of each replica's mean-loss gradient.

    ``part`` holds the rows of this process's replicas (one range each); ``average`` takes the
    mean of its tensors over the other processes' replicas (a data-parallel group) and must
    return the same on every member. Returns the update's groups (a mean over the group: the
    same on every member) and its loss, KL and clip share, weighted the same way.
    """
    groups, sums = 0, torch.zeros(3, dtype=torch.float32)
    for rows in part:
        if not len(rows):
            continue  # a replica without groups this update adds nothing (and weighs nothing)
        out = _part_loss(policy, batch, ref_BT, adv_B, rows, group_size, temperature, loss)
        (len(rows) * out.loss).backward()
        groups += len(rows)
        sums += len(rows) * torch.tensor([out.loss.item(), out.kl, out.clip_fraction], dtype=torch.float32)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    stats = torch.cat([torch.tensor([float(groups)], dtype=torch.float32), sums])
    if average is not None:
        *grads, stats = average([*grads, stats], exact=1)  # the groups count scales the gradients
    mean_groups = float(stats[0])
    if mean_groups <= 0:  # no replica had a group: no update anywhere
        for p in params:
            p.grad = None
        return 0.0, (0.0, 0.0, 0.0)
    for p, g in zip(params, grads, strict=True):
        p.grad = g / mean_groups
    loss_mean, kl, clip = (float(v) / mean_groups for v in stats[1:])
    return mean_groups, (loss_mean, kl, clip)
