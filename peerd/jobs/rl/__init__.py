"""The ``rl`` job's runtime between peers: one trainer, rollout peers, weights and rollouts over p2p.

- ``shards``: the pure plan (sizes, problems, shards, sampling seeds);
- ``messages``: the ``rl.*`` wire family (protocols/rl.md) and its checks;
- ``learner``: the trainer's arithmetic (warm-up, reference, GRPO updates), pure;
- ``reference``: the single-process sharded reference a swarm run is checked against;
- ``intake``: the trainer's intake of shards (taken, turned down, refused, waited for), pure;
- ``means``: the data-parallel trainers' averaging (gradients maybe compressed, figures exact);
- ``trainer`` / ``rollout``: the two roles, thin async shells over the above;
- ``runner``: ``RLRunner``, this peer's role across commits (the job manager's runner for ``rl``);
- ``progress``: the trainer's figures in its progress record and back.
"""

from peerd.jobs.rl.learner import Learner, TrainFigures
from peerd.jobs.rl.reference import reference_run
from peerd.jobs.rl.report import IterationReport
from peerd.jobs.rl.rollout import RolloutConfig, RolloutPeer, RolloutStats
from peerd.jobs.rl.runner import RLRunner
from peerd.jobs.rl.shards import RLPlan, Shard, assign_shards, shard_ranges
from peerd.jobs.rl.trainer import RLTrainer, TrainerConfig

__all__ = [
    "IterationReport",
    "Learner",
    "RLPlan",
    "RLRunner",
    "RLTrainer",
    "RolloutConfig",
    "RolloutPeer",
    "RolloutStats",
    "Shard",
    "TrainFigures",
    "TrainerConfig",
    "assign_shards",
    "reference_run",
    "shard_ranges",
]
