"""The ``rl`` job's runtime between peers: one trainer, rollout peers, weights and rollouts over p2p.

- ``shards``: the pure plan (sizes, problems, shards, sampling seeds);
- ``messages``: the ``rl.*`` wire family (protocols/rl.md) and its checks;
- ``learner``: the trainer's arithmetic (warm-up, reference, GRPO updates), pure;
- ``reference``: the single-process sharded reference a swarm run is checked against;
- ``trainer`` / ``rollout``: the two roles, thin async shells over the above.
"""

from peerd.jobs.rl.learner import Learner, TrainFigures
from peerd.jobs.rl.reference import reference_run
from peerd.jobs.rl.report import IterationReport
from peerd.jobs.rl.rollout import RolloutConfig, RolloutPeer, RolloutStats
from peerd.jobs.rl.shards import RLPlan, shard_ranges
from peerd.jobs.rl.trainer import RLTrainer, TrainerConfig

__all__ = [
    "IterationReport",
    "Learner",
    "RLPlan",
    "RLTrainer",
    "RolloutConfig",
    "RolloutPeer",
    "RolloutStats",
    "TrainFigures",
    "TrainerConfig",
    "reference_run",
    "shard_ranges",
]
