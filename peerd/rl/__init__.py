"""GRPO post-training, pure and single-process: tasks, cached rollouts, the loss, the staleness buffer, a trainer.

The swarm job kind ``rl`` (``peerd.jobs``) runs these pieces on rollout, reference and training
peers; nothing here does I/O or knows about peers.
"""

from peerd.rl.buffer import BufferStats, RolloutBuffer
from peerd.rl.loss import GRPOLossConfig, LossParts, group_advantages, grpo_loss, k3_kl
from peerd.rl.rollout import RolloutGroup, SamplingConfig, generate, pack, rollout, token_logprobs
from peerd.rl.tasks import TASKS, Problem, RewardConfig, Score, Task, TaskConfig, make_task, register_task
from peerd.rl.trainer import GRPOConfig, GRPOTrainer, IterationStats, evaluate
from peerd.rl.update import UpdateFigures, frozen_copy, grpo_updates
from peerd.rl.warmup import WarmupConfig, supervised_warmup

__all__ = [
    "TASKS",
    "BufferStats",
    "GRPOConfig",
    "GRPOLossConfig",
    "GRPOTrainer",
    "IterationStats",
    "LossParts",
    "Problem",
    "RewardConfig",
    "RolloutBuffer",
    "RolloutGroup",
    "SamplingConfig",
    "Score",
    "Task",
    "TaskConfig",
    "UpdateFigures",
    "WarmupConfig",
    "evaluate",
    "frozen_copy",
    "generate",
    "group_advantages",
    "grpo_loss",
    "grpo_updates",
    "k3_kl",
    "make_task",
    "pack",
    "register_task",
    "rollout",
    "supervised_warmup",
    "token_logprobs",
]
