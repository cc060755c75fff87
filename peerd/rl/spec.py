"""The ``rl:`` section of a job spec (``kind: rl``): the task, GRPO's knobs, the sampling, the warm-up.

How an ``rl`` job reads the rest of the spec (``peerd.jobs.spec`` checks it):

- ``steps`` is the number of GRPO iterations; ``global_batch`` the completions per iteration
  (``prompts x group_size``); ``micro_batch`` the completions of one optimizer update
  (``global_batch / updates_per_iteration``, each update one pass: no accumulation);
- ``optimizer`` is what the trainer runs (AdamW/Adam/SGD, schedule over the iterations' updates,
  clipping); ``model`` a built-in GPT (the KV-cached sampler runs over its layers), from its seeded
  init or from ``init_checkpoint`` (a ``peerd fetch`` output of that model, read by the trainers),
  then ``rl.warmup``;
- ``parallel.d_dp`` trainers (``d_pp`` 1; ``auto``: the consensus chooses among the counts that
  split an update's groups equally), data parallel: each trains on its equal
  share of every update's groups (so ``micro_batch / group_size`` is a multiple of ``d_dp``) and
  they average each update's gradients (in fp32, or at ``compression.gradient_bits`` with error
  feedback: the only ``compression`` field an rl job reads, refused where only one trainer can run); every
  other peer of the allocation is a rollout peer, dealt round-robin over the trainers, and a
  trainer left without one samples its share itself
  (with ``d_dp`` peers, every one of them: the colocated plan). ``min_peers`` is at least ``d_dp``;
  ``max_peers``, when given, leaves room for ``rl.min_rollout_peers`` beside the trainers.

Nothing here does I/O; the job's runtime lives in ``peerd.jobs.rl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from peerd.errors import ConfigError
from peerd.loading import Range
from peerd.rl.loss import GRPOLossConfig
from peerd.rl.rollout import SamplingConfig
from peerd.rl.tasks import TaskConfig
from peerd.rl.warmup import WarmupConfig


@dataclass
class RLSpec:
    """What an ``rl`` job trains for and how it samples; the sizes come from the job spec itself."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """The verifiable task the problems and rewards come from (``peerd.rl.tasks``)."""
    group_size: Annotated[int, Range(ge=2, le=1024)] = 8
    """Completions per prompt (G); advantages are relative to the group, so at least 2."""
    epochs: Annotated[int, Range(ge=1, le=64)] = 1
    """Passes over an iteration's rollouts (later passes are off-policy, held by the clip)."""
    staleness: Annotated[int, Range(ge=0, le=64)] = 0
    """Async depth k: rollouts of policy version >= v - k train version v (0: synchronous, on-policy).
    With k >= 1 rollout peers generate the next iterations while the trainer trains; older rollouts
    are dropped and counted."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout sampling (temperature must be > 0: GRPO needs different completions)."""
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """Clip range, KL coefficient (k3 to the frozen reference), token or sequence mean."""
    warmup: WarmupConfig = field(default_factory=lambda: WarmupConfig(steps=0))
    """Supervised warm-up on correct answers that the trainer runs before iteration 0 (``steps: 0``
    starts GRPO from the model's initial weights); the reference is the policy after it."""
    min_rollout_peers: Annotated[int, Range(ge=0, le=4096)] = 0
    """Peers the allocation keeps as rollout peers at least, where the roster (and ``max_peers``) has
    them beyond the trainers; the consensus may choose more. 0: it chooses freely, and may give
    every prompt to the trainers, which sample their own shares (fastest where the peers share one
    machine's cores). Async mode (``staleness`` >= 1) overlaps generation with training only on
    rollout peers."""
    rollout_timeout_s: Annotated[float, Range(gt=0, le=3600)] = 120.0
    """How long the trainer waits for an iteration's rollout shards; a shard still missing then is
    dropped (counted) and the iteration trains on the others."""

    def problems(self) -> list[ConfigError]:
        out = []
        if self.sampling.temperature == 0:
            out.append(ConfigError("sampling.temperature", "GRPO needs sampled completions: must be > 0"))
        return out
