"""The trainer's arithmetic, pure: warm-up, frozen reference, and one GRPO iteration's updates with the spec's optimizer.

Both the trainer peer (``peerd.jobs.rl.trainer``) and the single-process reference
(``peerd.jobs.rl.reference``) train through ``Learner``, so a swarm run and the reference
differ only in how the rollouts got to it. One iteration: the groups (scored by the trainer's
own verifier) are laid out in shard order, the reference scores their tokens once, then
``epochs`` passes of updates, each update on ``micro_batch / group_size`` whole groups
(the first pass on-policy where the rollouts are fresh; later ones held by the clip). The
optimizer and its LR schedule are ``peerd.pipeline.optim``'s, over every update of the job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peerd.compress.device import host_copy
from peerd.jobs.optimizer import optimizer_config
from peerd.jobs.rl.shards import RLPlan, shard_ranges
from peerd.models.gpt import GPT
from peerd.models.registry import with_weights
from peerd.pipeline import checkpoint
from peerd.pipeline.optim import build_optimizer, build_scheduler
from peerd.rl.rollout import RolloutGroup, pack, token_logprobs
from peerd.rl.update import Average, frozen_copy, grpo_updates
from peerd.rl.warmup import WarmupResult, supervised_warmup
from peerd.rl.weights import policy_weights


@dataclass(frozen=True)
class TrainFigures:
    """What one iteration's updates measured."""

    loss: float
    """GRPO loss of the first pass, weighted by each update's share of the groups."""
    kl: float
    """Mean k3 KL to the reference over the first pass (before any update of this iteration)."""
    clip_fraction: float
    """Share of completion tokens clipped, averaged over every update."""
    updates: int
    reference_s: float = 0.0
    """Seconds the reference's log-probs took."""
    train_s: float = 0.0
    """Seconds the updates took."""
    average_s: float = 0.0
    """Of ``train_s``, the seconds spent in the data-parallel trainers' averages (0 for a lone trainer)."""


class Learner:
    """The policy, its frozen reference and optimizer; ``version`` counts the iterations trained."""

    def __init__(self, plan: RLPlan, device: torch.device | str = "cpu") -> None:
        model = plan.spec.model.family().build()
        assert isinstance(model, GPT), "rl jobs run the built-in GPT (JobSpec checks model.hf)"
        self.device = torch.device(device)
        model.to(self.device)
        self.plan = plan
        self.policy: GPT = model
        self.reference: GPT = frozen_copy(model)
        self.optimizer = build_optimizer(self.policy.parameters(), optimizer_config(plan.spec.optimizer))
        self.scheduler = build_scheduler(
            self.optimizer, optimizer_config(plan.spec.optimizer), plan.total_updates
        )
        self.grad_clip = plan.spec.optimizer.grad_clip
        self.numel = sum(t.numel() for t in model.state_dict().values())
        """Values in the policy's state dict (what a weights blob holds)."""
        self.version = 0
        self.torn = False
        """An iteration's updates failed part-way (its average): the policy is no version's."""

    def warm_up(self) -> WarmupResult:
        """The spec's starting point: the ``init_checkpoint``'s weights (if any; ConfigError naming the
        field when they do not load into the job's model), then its supervised warm-up
        (deterministic: its own seed); the reference is the policy after it."""
        path = self.plan.spec.init_checkpoint
        if path is not None:
            start = with_weights(self.plan.spec.model.family(), path).build()
            with torch.no_grad():
                self.policy.load_state_dict(start.state_dict())
        result = supervised_warmup(self.policy, self.plan.task, self.plan.rl.warmup)
        self.reference = frozen_copy(self.policy)
        return result

    def weights(self) -> dict[str, torch.Tensor]:
        """A host copy of the policy's weights (what rollout peers load and checkpoints hold)."""
        return policy_weights(self.policy)

    def train(
        self,
        groups: list[RolloutGroup],
        replicas: Sequence[int] | None = None,
        average: Average | None = None,
    ) -> TrainFigures:
        """One iteration's updates on scored ``groups``; the version goes up by one.

        Data-parallel trainers: ``replicas`` counts the groups of each replica, laid out replica
        by replica (the single-process reference of several trainers), or ``average`` is the
        trainers' group mean and ``groups`` this trainer's own (``peerd.rl.update``). Either way
        each replica's groups are cut into the iteration's updates, so every replica steps as
        often, even one that holds fewer groups than planned.
        """
        figures = TrainFigures(0.0, 0.0, 0.0, 0)
        if groups or average is not None:
            self.torn = True  # until every update is in: a failed average leaves a policy of no version
            figures = self._updates(groups, self.plan.rl.sampling.temperature, replicas, average)
        self.version += 1
        self.torn = False
        return figures

    def align(self, average: Average) -> None:
        """Set the policy and the reference to the data-parallel trainers' mean of each, so trainers
        that warmed up on different hardware (rounding differently) start from the same weights."""
        self.torn = True  # until both are in
        for model in (self.policy, self.reference):
            values = [v for v in model.state_dict().values() if v.is_floating_point()]
            with torch.no_grad():
                for v, mean in zip(
                    values, average([v.detach() for v in values], exact=len(values)), strict=True
                ):
                    v.copy_(mean)
        self.torn = False

    def _parts(self, groups: int, replicas: Sequence[int] | None, dp: bool) -> list[list[range]]:
        per = self.plan.groups_per_update
        if replicas is None and not dp:  # one trainer: whole updates of ``per`` groups
            return [[range(a, min(a + per, groups))] for a in range(0, groups, per)]
        counts = list(replicas) if replicas is not None else [groups]
        assert sum(counts) == groups, "replicas must count every group"
        updates = self.plan.updates_per_iteration
        starts = [sum(counts[:r]) for r in range(len(counts))]
        cuts = [shard_ranges(n, updates) for n in counts]
        return [
            [range(o + c[u].start, o + c[u].stop) for o, c in zip(starts, cuts, strict=True)]
            for u in range(updates)
        ]

    def _updates(
        self,
        groups: list[RolloutGroup],
        temperature: float,
        replicas: Sequence[int] | None,
        average: Average | None,
    ) -> TrainFigures:
        plan, rl = self.plan, self.plan.rl
        started = time.perf_counter()
        batch = pack(groups, self.device)
        ref_BT = torch.zeros(0, 0, device=self.device)  # no group here: this replica only averages
        if groups:
            with torch.no_grad():
                ref_BT = token_logprobs(self.reference, batch.tokens_BT, temperature)
        scored = time.perf_counter()
        averaging = 0.0

        def timed_average(tensors: list[torch.Tensor], exact: int = 0) -> list[torch.Tensor]:
            nonlocal averaging
            began = time.perf_counter()
            try:
                assert average is not None
                return average(tensors, exact)
            finally:
                averaging += time.perf_counter() - began

        figures = grpo_updates(
            self.policy,
            self.optimizer,
            batch,
            ref_BT,
            [g.rewards for g in groups],
            self._parts(len(groups), replicas, average is not None),
            group_size=plan.group_size,
            epochs=rl.epochs,
            temperature=temperature,
            loss=rl.loss,
            grad_clip=self.grad_clip,
            after_step=self.scheduler.step,
            average=timed_average if average is not None else None,
        )
        return TrainFigures(
            loss=figures.loss,
            kl=figures.kl,
            clip_fraction=figures.clip_fraction,
            updates=figures.updates,
            reference_s=scored - started,
            train_s=time.perf_counter() - scored,
            average_s=averaging,
        )

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint of this job (``checkpoint_state``)."""
        self.policy.load_state_dict(state["module"])
        self.reference.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["step"])

    def checkpoint_state(self) -> dict[str, Any]:
        """The learner in the one-stage checkpoint format (``peerd.jobs.fetch.assemble`` reads it,
        ``restore`` continues from it), host tensors."""
        plan = self.plan
        return host_copy(
            {
                "format": checkpoint.FORMAT,
                "job": plan.job_id,
                "stage": 0,
                "replica": 0,
                "step": self.version,
                "module": self.weights(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "reference": self.reference.state_dict(),
                "data": {"kind": "rl", "iteration": self.version, "seed": plan.seed},
                "meta": {"layers": [0, plan.spec.model.family().num_layers], "saved_at": time.time()},
            }
        )
