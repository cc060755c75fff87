"""The GRPO objective: group-relative advantages, a clipped token-level ratio, and a k3 KL penalty.

With ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the G completions of one prompt
(DeepSeekMath, Shao et al. 2024, eq. 3; ``std`` is the sample standard deviation, so G >= 2),
every completion token t of completion i contributes

    ratio   = exp(logp - logp_behaviour)
    surr    = min(ratio * A_i, clip(ratio, 1 - clip_low, 1 + clip_high) * A_i)
    kl      = exp(logp_ref - logp) - (logp_ref - logp) - 1        (k3: unbiased, >= 0)
    loss_t  = -(surr - kl_coef * kl)

Prompt and pad tokens carry mask 0 and add nothing. ``token-mean`` averages ``loss_t`` over all
completion tokens of the batch (long completions weigh more, as in DAPO); ``seq-mean`` averages
within each completion first, then over completions (the paper's 1/|o_i| form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from peerd.errors import ConfigError
from peerd.loading import Range

Aggregation = Literal["token-mean", "seq-mean"]


@dataclass
class GRPOLossConfig:
    """Terms of the GRPO loss."""

    clip_low: Annotated[float, Range(gt=0, lt=1)] = 0.2
    """The ratio is clipped below at ``1 - clip_low``."""
    clip_high: Annotated[float, Range(gt=0, le=100)] = 0.2
    """... and above at ``1 + clip_high`` (DAPO raises it to leave low-probability tokens room)."""
    kl_coef: Annotated[float, Range(ge=0, le=1000)] = 0.04
    """Weight of the k3 KL penalty to the frozen reference; 0 turns it off."""
    adv_eps: Annotated[float, Range(gt=0, le=1)] = 1e-4
    """Added to the group's reward std, so a group of equal rewards gets advantage 0, not NaN."""
    aggregation: Aggregation = "token-mean"
    """``token-mean`` or ``seq-mean`` (see the module docstring)."""


def group_advantages(rewards_NG: torch.Tensor, eps: float) -> torch.Tensor:
    """(N, G) rewards of N groups -> (N, G) advantages, normalised within each group."""
    if rewards_NG.dim() != 2 or rewards_NG.shape[1] < 2:
        raise ConfigError(
            "group_size", f"advantages need groups of >= 2 completions, got shape {tuple(rewards_NG.shape)}"
        )
    mean_N1 = rewards_NG.mean(dim=1, keepdim=True)
    std_N1 = rewards_NG.std(dim=1, keepdim=True)
    return (rewards_NG - mean_N1) / (std_N1 + eps)


def k3_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from samples of the policy."""
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1


@dataclass
class LossParts:
    """The loss to differentiate and what went into it (floats, for logs)."""

    loss: torch.Tensor
    policy: float
    """Mean clipped surrogate (the term maximised)."""
    kl: float
    """Mean k3 KL to the reference over completion tokens."""
    clip_fraction: float
    """Share of completion tokens whose ratio was clipped (the clip changed the objective)."""
    ratio_mean: float


def _aggregate(x_BT: torch.Tensor, mask_BT: torch.Tensor, how: Aggregation) -> torch.Tensor:
    if how == "token-mean":
        return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    per_row_B = (x_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
    rows = (mask_BT.sum(dim=1) > 0).float()
    return (per_row_B * rows).sum() / rows.sum().clamp(min=1)


def grpo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor | None,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: GRPOLossConfig,
) -> LossParts:
    """The GRPO loss of a batch of completions (rows), differentiable through ``logp_BT`` only.

    ``old_logp_BT``: behaviour log-probs (from the rollout); ``ref_logp_BT``: the reference's (None
    when ``kl_coef`` is 0); ``adv_B``: each row's group advantage; ``mask_BT``: 1 at completion tokens.
    """
    if ref_logp_BT is None and cfg.kl_coef > 0:
        raise ConfigError("kl_coef", "a KL penalty needs reference log-probs")
    mask_BT = mask_BT.to(logp_BT.dtype)
    ratio_BT = torch.exp(logp_BT - old_logp_BT.detach())
    adv_B1 = adv_B.detach()[:, None]
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = ratio_BT.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv_B1
    surr_BT = torch.minimum(unclipped_BT, clipped_BT)
    per_token_BT = -surr_BT
    kl_BT = torch.zeros_like(logp_BT)
    if ref_logp_BT is not None:
        kl_BT = k3_kl(logp_BT, ref_logp_BT.detach())
        if cfg.kl_coef > 0:
            per_token_BT = per_token_BT + cfg.kl_coef * kl_BT
    loss = _aggregate(per_token_BT, mask_BT, cfg.aggregation)
    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1)
        clipped = (clipped_BT < unclipped_BT).to(mask_BT.dtype)
        return LossParts(
            loss=loss,
            policy=float(_aggregate(surr_BT, mask_BT, cfg.aggregation)),
            kl=float((kl_BT * mask_BT).sum() / n),
            clip_fraction=float((clipped * mask_BT).sum() / n),
            ratio_mean=float((ratio_BT * mask_BT).sum() / n),
        )
