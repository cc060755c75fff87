"""Rollouts: G sampled completions per prompt from one policy version, with the log-probs that drew them.

``generate`` decodes a batch of left-padded prompts in lockstep through the KV cache
(``peerd.rl.kvcache``), sampling each next token with temperature and top-k from a seeded
``torch.Generator``; a row stops at the end marker or at ``max_new_tokens``. The behaviour
log-prob of each sampled token is taken from the *untruncated* tempered distribution,
``log_softmax(logits / temperature)``, which is what the trainer computes for the same token
(``token_logprobs``), so the importance ratio of an on-policy token is 1 up to rounding.
(Top-k changes which tokens can be drawn, not the log-prob the ratio uses, as in verl/TRL.)

``RolloutGroup`` is the unit everything downstream works on: one prompt's G completions, made
by one policy ``version`` (the staleness buffer and the advantages both work per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Annotated

import numpy as np
import torch
import torch.nn.functional as F

from peerd.errors import ConfigError
from peerd.loading import Range
from peerd.models.gpt import GPT
from peerd.rl.kvcache import KVCache, cached_forward, gpt_parts
from peerd.rl.tasks import END_TOKEN, PAD_TOKEN, Problem, Score


@dataclass
class SamplingConfig:
    """How rollout peers sample."""

    max_new_tokens: Annotated[int, Range(ge=1, le=1 << 16)] = 8
    """Longest completion, end marker included; a row that reaches it unfinished is cut there."""
    temperature: Annotated[float, Range(ge=0, le=100)] = 1.0
    """Logits are divided by it; 0 means greedy (argmax), for evaluation."""
    top_k: Annotated[int, Range(ge=0, le=1 << 20)] = 0
    """Sample among the k most likely tokens only; 0 = the whole vocabulary."""


@dataclass
class Generation:
    """Completions of a batch of prompts, in prompt order."""

    completions: list[list[int]]
    """Tokens of each completion, up to and including the end marker when it was sampled."""
    logprobs: list[list[float]]
    """Behaviour log-prob of each completion token."""


@dataclass
class RolloutGroup:
    """G completions of one problem by one policy version, and (after the reward phase) their scores."""

    problem: Problem
    completions: list[list[int]]
    logprobs: list[list[float]]
    version: int
    """Policy version (trainer updates applied) of the weights that sampled it."""
    scores: list[Score] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.completions)

    @property
    def rewards(self) -> list[float]:
        assert len(self.scores) == self.size, "group not scored yet"
        return [s.reward for s in self.scores]


def _sample(
    logits_BV: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (B,) and their behaviour log-probs (B,)."""
    logits_BV = logits_BV.float()
    if cfg.temperature == 0:
        tokens_B = logits_BV.argmax(dim=-1)
        logp_BV = F.log_softmax(logits_BV, dim=-1)
    else:
        logp_BV = F.log_softmax(_tempered(logits_BV, cfg.temperature), dim=-1)
        draw_BV = logp_BV
        if 0 < cfg.top_k < logits_BV.shape[-1]:
            kth_B1 = logp_BV.topk(cfg.top_k, dim=-1).values[:, -1:]
            draw_BV = logp_BV.masked_fill(logp_BV < kth_B1, float("-inf"))
        tokens_B = draw(draw_BV.exp(), gen)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None]).squeeze(1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; the logits themselves at 1 (the same values, one pass over them fewer)."""
    return logits if temperature == 1.0 else logits / temperature


def draw(probs_BV: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row, with probability proportional to ``probs_BV`` (>= 0, a positive row sum).

    The inverse of each row's CDF at one uniform draw: one random number per row, where
    ``torch.multinomial`` takes per-row set-up that made it ~20x slower for a batch of 128 rows of
    256 on a CPU. The CDF accumulates in float64, and the first index whose CDF passes the draw
    is taken, so a zero-probability index is never drawn.
    """
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    u_B1 = torch.rand((probs_BV.shape[0], 1), generator=gen, dtype=torch.float64, device=probs_BV.device)
    picked_B = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True).squeeze(1)
    # u * total rounding up to total (u < 1) runs past the end: the row's last possible index
    last_B = probs_BV.shape[1] - 1 - (probs_BV > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(picked_B, last_B)


@torch.no_grad()
def generate(
    model: GPT, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, gen: torch.Generator
) -> Generation:
    """Sample one completion per prompt (repeat a prompt G times for a group)."""
    gpt_parts(model)  # refuse other models before any work
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("prompts", "need at least one prompt, each of at least one token")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    lens_B = torch.tensor([len(p) for p in prompts], device=device)
    pad_B = P - lens_B
    tokens_BP = torch.full((B, P), PAD_TOKEN, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens_BP[i, P - len(p) :] = torch.tensor(list(p), dtype=torch.long)
    slots_P = torch.arange(P, device=device)
    positions_BP = (slots_P[None, :] - pad_B[:, None]).clamp(min=0)
    cache = KVCache(model, B, P + cfg.max_new_tokens - 1)
    key_mask_BS = torch.zeros((B, cache.capacity), dtype=torch.bool, device=device)
    key_mask_BS[:, :P] = slots_P[None, :] >= pad_B[:, None]

    logits_BV = cached_forward(model, tokens_BP, positions_BP, key_mask_BS[:, :P], cache)[:, -1]
    out_tokens, out_logp = [], []
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(cfg.max_new_tokens):
        next_B, logp_B = _sample(logits_BV, cfg, gen)
        next_B = next_B.masked_fill(done_B, PAD_TOKEN)
        out_tokens.append(next_B)
        out_logp.append(logp_B)
        done_B = done_B | (next_B == END_TOKEN)
        if bool(done_B.all()) or step == cfg.max_new_tokens - 1:
            break
        slot = P + step
        key_mask_BS[:, slot] = True  # finished rows keep decoding pads nobody reads
        positions_B1 = (lens_B + step)[:, None]
        logits_BV = cached_forward(model, next_B[:, None], positions_B1, key_mask_BS[:, : slot + 1], cache)[
            :, -1
        ]
    model.train(was_training)

    toks_BN = torch.stack(out_tokens, dim=1).tolist()
    logp_BN = torch.stack(out_logp, dim=1).tolist()
    completions, logprobs = [], []
    for toks, lps in zip(toks_BN, logp_BN, strict=True):
        n = toks.index(END_TOKEN) + 1 if END_TOKEN in toks else len(toks)
        completions.append(toks[:n])
        logprobs.append(lps[:n])
    return Generation(completions, logprobs)


def rollout(
    model: GPT,
    problems: Sequence[Problem],
    group_size: int,
    cfg: SamplingConfig,
    gen: torch.Generator,
    version: int,
) -> list[RolloutGroup]:
    """``group_size`` completions of each problem in one batched generation, tagged with ``version``."""
    if group_size < 1:
        raise ConfigError("group_size", f"must be >= 1, got {group_size}")
    prompts = [p.prompt_ids for p in problems for _ in range(group_size)]
    g = generate(model, prompts, cfg, gen)
    groups = []
    for i, problem in enumerate(problems):
        part = slice(i * group_size, (i + 1) * group_size)
        groups.append(RolloutGroup(problem, g.completions[part], g.logprobs[part], version))
    return groups


@dataclass
class PackedBatch:
    """Rollouts as right-padded training tensors: row = prompt + completion + pads.

    Targets are ``tokens_BT[:, 1:]``; the ``(B, T-1)`` tensors below are aligned with them.
    """

    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor
    """1.0 at completion targets (end marker included), 0.0 at prompt and pad targets."""
    old_logp_BT: torch.Tensor
    """Behaviour log-probs at completion targets (0 elsewhere)."""
    rows: list[tuple[int, int]]
    """(group index, completion index) of each row."""

    @property
    def tokens(self) -> int:
        return int(self.mask_BT.sum().item())


def _rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """``layout``'s arrays: int64 tokens (B, T) and float32 completion-target mask (B, T-1)."""
    if not all(prompts):
        raise ValueError("every row needs a prompt token: the first completion token is predicted from it")
    B = len(prompts)
    plen = np.fromiter(map(len, prompts), dtype=np.int64, count=B)
    ends = plen + np.fromiter(map(len, completions), dtype=np.int64, count=B)
    T = int(ends.max()) if B else 1  # no rows: an empty batch
    pairs = zip(prompts, completions, strict=True)
    flat = np.fromiter(
        chain.from_iterable(chain(p, c) for p, c in pairs), dtype=np.int64, count=int(ends.sum())
    )
    at = np.arange(T)
    tokens = np.full((B, T), PAD_TOKEN, dtype=np.int64)
    tokens[at < ends[:, None]] = flat  # row-major: each row's prompt + completion, then pads
    # target index t predicts token t+1: completion token j sits at target index len(p) - 1 + j
    t = at[: T - 1]
    mask = ((t >= (plen - 1)[:, None]) & (t < (ends - 1)[:, None])).astype(np.float32)
    return tokens, mask


def layout(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows ``prompt + completion`` (B, T) and the (B, T-1) mask of completion targets.

    Built with numpy from the flattened token lists and wrapped as tensors without a copy: per-row
    tensor ops would cost a tiny policy's trainer more than its forward pass (11 dispatched ops a
    row), and per-row Python lists 0.3 ms of its 2 ms reference pass at 128 rows.
    """
    tokens, mask = _rows(prompts, completions)
    return torch.from_numpy(tokens).to(device), torch.from_numpy(mask).to(device)


def pack(groups: Sequence[RolloutGroup], device: torch.device | str = "cpu") -> PackedBatch:
    """Lay every completion of ``groups`` out as one right-padded batch."""
    rows = [(gi, ci) for gi, g in enumerate(groups) for ci in range(g.size)]
    prompts = [groups[gi].problem.prompt_ids for gi, _ in rows]
    tokens, mask = _rows(prompts, [groups[gi].completions[ci] for gi, ci in rows])
    # the behaviour log-probs fill the completion targets, row by row in order (as the mask's ones)
    old = np.zeros(mask.shape, dtype=np.float32)
    targets = mask.astype(bool)
    lps = chain.from_iterable(groups[gi].logprobs[ci] for gi, ci in rows)
    old[targets] = np.fromiter(lps, dtype=np.float32, count=int(targets.sum()))
    tokens_BT, mask_BT, old_BT = (torch.from_numpy(a).to(device) for a in (tokens, mask, old))
    return PackedBatch(tokens_BT, mask_BT, old_BT, rows)


def token_logprobs(model: GPT, tokens_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob (B, T-1) of each next token under ``model`` (the plain, uncached forward)."""
    logits_BTV = model(tokens_BT[:, :-1]).float()
    if temperature > 0:
        logits_BTV = _tempered(logits_BTV, temperature)
    return F.log_softmax(logits_BTV, dim=-1).gather(2, tokens_BT[:, 1:, None]).squeeze(2)
