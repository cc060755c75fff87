"""A single-process GRPO trainer: the four tasks of an iteration in order, each timed.

One iteration, as the RL cost model (``peerd.sched.rl.workflow``) names its tasks:

1. ``generate``: ``prompts_per_step`` fresh problems, ``group_size`` completions each, sampled by
   the rollout copy of the policy (version-tagged);
2. ``reward``: every completion scored by the task's verifier;
3. ``reference``: log-probs of the completions under the frozen reference;
4. ``actor_train``: group advantages, then ``epochs`` passes of ``updates_per_iteration`` optimizer
   steps on equal slices of the batch (the first on-policy, later ones off-policy: that is what
   the clip is for);
   the policy version goes up by one per iteration (one weight publication);
5. ``weight_sync``: the rollout copy takes the new weights. With ``staleness = 0`` the rollout
   copy *is* the policy; with ``staleness = k`` it is refreshed only when it would otherwise fall
   more than ``k`` versions behind (what an async swarm with bounded staleness sees).

The swarm job runs the same pieces on different peers; this loop is its single-process reference.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Annotated

import torch

from peerd.errors import ConfigError
from peerd.loading import Range, check, problems
from peerd.log import get_logger
from peerd.models.gpt import GPT
from peerd.rl.buffer import RolloutBuffer
from peerd.rl.loss import GRPOLossConfig
from peerd.rl.rollout import RolloutGroup, SamplingConfig, pack, rollout, token_logprobs
from peerd.rl.tasks import Problem, Task
from peerd.rl.update import frozen_copy, grpo_updates

log = get_logger(__name__)

PHASES = ("generate", "reward", "reference", "actor_train", "weight_sync")


@dataclass
class GRPOConfig:
    """A GRPO run."""

    group_size: Annotated[int, Range(ge=2)] = 8
    """Completions per prompt (G); the advantage is relative to the group, so at least 2."""
    prompts_per_step: Annotated[int, Range(ge=1)] = 16
    """Prompts per iteration; an iteration trains on ``prompts_per_step * group_size`` completions."""
    updates_per_iteration: Annotated[int, Range(ge=1)] = 1
    """Optimizer steps per pass over the iteration's rollouts, each on an equal slice of the groups."""
    epochs: Annotated[int, Range(ge=1)] = 1
    """Passes over the iteration's rollouts (GRPO's mu): later passes are off-policy, held by the clip."""
    lr: Annotated[float, Range(gt=0)] = 1e-3
    """AdamW learning rate (constant)."""
    grad_clip: Annotated[float, Range(ge=0)] = 1.0
    """Clip the gradient's global norm to this; 0 = no clipping."""
    staleness: Annotated[int, Range(ge=0)] = 0
    """Largest policy-version lag of a rollout used for training; 0 = sync mode."""
    seed: int = 0
    """Seeds the problems and the sampling."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)

    def problems(self) -> list[ConfigError]:
        out = []
        if self.sampling.temperature == 0:
            out.append(ConfigError("sampling.temperature", "GRPO needs sampled completions: must be > 0"))
        if self.updates_per_iteration > self.prompts_per_step:
            out.append(
                ConfigError(
                    "updates_per_iteration",
                    f"each update needs at least one group: must be <= prompts_per_step={self.prompts_per_step}",
                )
            )
        return out


@dataclass
class IterationStats:
    """One iteration's figures (what the RL job publishes per iteration)."""

    iteration: int
    version: int
    """Policy version after this iteration's update."""
    reward_mean: float
    pass_rate: float
    """Share of this iteration's completions that are exactly correct."""
    format_rate: float
    kl: float
    """Mean k3 KL to the reference over completion tokens, before the update."""
    response_len: float
    """Mean completion length in tokens (end marker included)."""
    clip_fraction: float
    """Share of completion tokens clipped, averaged over every update of the iteration."""
    loss: float
    rollouts: int
    """Completions trained on."""
    prompt_tokens: int
    """Tokens of the prompts of those completions (prefill work of the generation)."""
    completion_tokens: int
    """Tokens of the completions (what training and the reference score)."""
    decode_steps: int
    """Steps the lockstep decoder ran: the longest completion of the iteration."""
    staleness: int
    """Version lag of this iteration's rollouts."""
    seconds: dict[str, float]
    """Seconds per phase (``PHASES``)."""


@dataclass
class EvalResult:
    pass_rate: float
    format_rate: float
    reward_mean: float
    response_len: float


def score_groups(task: Task, groups: list[RolloutGroup]) -> None:
    for g in groups:
        g.scores = [task.score(g.problem, c) for c in g.completions]


@torch.no_grad()
def evaluate(
    model: GPT, task: Task, eval_problems: list[Problem], samples: int, sampling: SamplingConfig, seed: int
) -> EvalResult:
    """Pass rate of ``samples`` completions per problem (fixed problems and seed: comparable across runs)."""
    gen = torch.Generator().manual_seed(seed)
    groups = rollout(model, eval_problems, samples, sampling, gen, version=-1)
    score_groups(task, groups)
    scores = [s for g in groups for s in g.scores]
    lens = [len(c) for g in groups for c in g.completions]
    n = len(scores)
    return EvalResult(
        pass_rate=sum(s.correct for s in scores) / n,
        format_rate=sum(s.well_formed for s in scores) / n,
        reward_mean=sum(s.reward for s in scores) / n,
        response_len=sum(lens) / n,
    )


class GRPOTrainer:
    """Trains ``policy`` in place with GRPO on ``task``; the reference is a frozen copy of its start."""

    def __init__(self, policy: GPT, task: Task, cfg: GRPOConfig, reference: GPT | None = None) -> None:
        check(problems(cfg, "grpo"), "the GRPO config")
        need = task.max_prompt_len + cfg.sampling.max_new_tokens
        if need > policy.cfg.max_seq_len:
            raise ConfigError(
                "grpo.sampling.max_new_tokens", f"prompt + completion ({need}) exceeds max_seq_len"
            )
        self.policy, self.task, self.cfg = policy, task, cfg
        self.reference = reference if reference is not None else frozen_copy(policy)
        self.rollout_policy = policy if cfg.staleness == 0 else frozen_copy(policy)
        self.version = 0
        self.rollout_version = 0
        self.buffer = RolloutBuffer(cfg.staleness)
        self.opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.device = next(policy.parameters()).device
        self.iteration = 0

    def step(self) -> IterationStats:
        """One iteration: generate, reward, reference, train, sync."""
        cfg, t = self.cfg, {k: 0.0 for k in PHASES}
        t0 = time.perf_counter()
        todo = [self.task.sample(self.rng) for _ in range(cfg.prompts_per_step)]
        made = rollout(
            self.rollout_policy, todo, cfg.group_size, cfg.sampling, self.gen, self.rollout_version
        )
        t1 = time.perf_counter()
        score_groups(self.task, made)
        t2 = time.perf_counter()
        self.buffer.add(made, self.version)
        groups = self.buffer.take(cfg.prompts_per_step, self.version)
        assert groups, "rollouts of the rollout copy are within the bound by construction"
        batch = pack(groups, self.device)
        temperature = cfg.sampling.temperature
        with torch.no_grad():
            ref_BT = token_logprobs(self.reference, batch.tokens_BT, temperature)
        t3 = time.perf_counter()

        figures = grpo_updates(
            self.policy,
            self.opt,
            batch,
            ref_BT,
            [g.rewards for g in groups],
            [[r] for r in _slices(len(groups), cfg.updates_per_iteration)],
            group_size=cfg.group_size,
            epochs=cfg.epochs,
            temperature=temperature,
            loss=cfg.loss,
            grad_clip=cfg.grad_clip,
        )
        self.version += 1
        t4 = time.perf_counter()
        if self.rollout_policy is self.policy:
            self.rollout_version = self.version
        elif self.version - self.rollout_version > cfg.staleness:
            self.rollout_policy.load_state_dict(self.policy.state_dict())
            self.rollout_version = self.version
        t5 = time.perf_counter()
        t.update(
            generate=t1 - t0, reward=t2 - t1, reference=t3 - t2, actor_train=t4 - t3, weight_sync=t5 - t4
        )

        scores = [s for g in groups for s in g.scores]
        lens = [len(c) for g in groups for c in g.completions]
        stats = IterationStats(
            iteration=self.iteration,
            version=self.version,
            reward_mean=sum(s.reward for s in scores) / len(scores),
            pass_rate=sum(s.correct for s in scores) / len(scores),
            format_rate=sum(s.well_formed for s in scores) / len(scores),
            kl=figures.kl,
            response_len=sum(lens) / len(lens),
            clip_fraction=figures.clip_fraction,
            loss=figures.loss,
            rollouts=len(scores),
            prompt_tokens=sum(len(g.problem.prompt_ids) * g.size for g in groups),
            completion_tokens=sum(lens),
            decode_steps=max(len(c) for g in made for c in g.completions),
            staleness=self.version - 1 - min(g.version for g in groups),
            seconds=t,
        )
        self.iteration += 1
        log.debug(
            "grpo iteration %d: reward %.3f pass %.3f kl %.4f",
            stats.iteration,
            stats.reward_mean,
            stats.pass_rate,
            figures.kl,
        )
        return stats


def _slices(n: int, parts: int) -> list[range]:
    """``n`` items cut into ``parts`` contiguous, near-equal ranges."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]
