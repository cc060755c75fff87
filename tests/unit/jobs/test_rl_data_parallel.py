"""Data-parallel rl trainers: each trains on its own groups and averages, and they equal the one-process reference."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.reference import reference_run
from peerd.jobs.rl.report import score, summarize
from peerd.jobs.rl.shards import RLPlan, assign_shards, sample_shard
from peerd.jobs.spec import parse_job_spec
from peerd.rl.rollout import RolloutGroup

ITERATIONS = 3


def plan() -> RLPlan:
    spec = {
        "kind": "rl",
        "name": "dp",
        "model": {"preset": "tiny", "seed": 3},
        "steps": ITERATIONS,
        "global_batch": 32,  # 8 prompts of 4: 4 per trainer
        "micro_batch": 16,  # 2 updates per iteration, each of 2 groups per trainer
        "min_peers": 2,
        "optimizer": {"lr": 3e-3},
        "rl": {
            "group_size": 4,
            "task": {"name": "addition", "min_size": 1, "max_size": 1},
            "sampling": {"max_new_tokens": 3, "temperature": 1.0},
            "warmup": {"steps": 40, "batch_size": 16, "lr": 0.003},
        },
    }
    return RLPlan("cd" * 16, parse_job_spec(spec))


class ThreadMean:
    """The mean over ``n`` threads of what each passes, the same tensors for all (a barrier per call)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0
        self.barrier = threading.Barrier(n)
        self.given: dict[int, list[torch.Tensor]] = {}
        self.result: list[torch.Tensor] = []

    def member(self, rank: int):
        def average(tensors: list[torch.Tensor], exact: int = 0) -> list[torch.Tensor]:
            # exact: nothing is compressed here
            self.given[rank] = [t.detach().clone() for t in tensors]
            if self.barrier.wait() == 0:
                self.calls += 1
                cols = zip(*(self.given[r] for r in range(self.n)), strict=True)
                self.result = [sum(c) / self.n for c in cols]
            self.barrier.wait()
            return [t.clone() for t in self.result]

        return average


def run_trainers(
    p: RLPlan, drop: tuple[int, int] | None = None, iterations: int = ITERATIONS
) -> tuple[list[Learner], list[list[RolloutGroup]]]:
    """Two trainers, each sampling its own range (no rollout peer); ``drop``: (iteration, trainer)
    whose groups are all lost."""
    shards = assign_shards(p.prompts, 2, [])
    learners = [Learner(p), Learner(p)]
    for learner in learners:
        learner.warm_up()
    mean = ThreadMean(2)
    everything: list[list[RolloutGroup]] = []
    for t in range(iterations):
        mine = []
        for r, learner in enumerate(learners):
            (shard,) = [s for s in shards if s.trainer == r]
            groups = sample_shard(learner.policy, p, t, shard.index, shard.problems, learner.version)
            score(p.task, groups)
            mine.append([] if drop == (t, r) else groups)
        everything.append(mine[0] + mine[1])
        with ThreadPoolExecutor(2) as pool:
            jobs = [
                pool.submit(lr.train, g, None, mean.member(r))
                for r, (lr, g) in enumerate(zip(learners, mine, strict=True))
            ]
            for job in jobs:
                job.result()
    assert mean.calls == iterations * p.updates_per_iteration  # one average per update, in lockstep
    return learners, everything


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_data_parallel_trainers_equal_the_one_process_reference_of_two():
    p = plan()
    learners, groups = run_trainers(p)
    a, b = (lr.policy.state_dict() for lr in learners)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the mean is the same tensor on both
    reference = reference_run(p, rollout_peers=0, trainers=2)
    for t, ref in enumerate(reference):
        assert summarize(groups[t]).reward_mean == pytest.approx(ref.reward_mean, abs=1e-9)
    # the rewards differ inside some group, so the updates move the policy (no vacuous equality)
    assert any(len(set(g.rewards)) > 1 for it in groups for g in it)
    ref_learner = Learner(p)
    ref_learner.warm_up()
    for t in range(ITERATIONS):  # the reference's policy, rebuilt on the same groups
        ref_learner.train(groups[t], replicas=[4, 4])
    want = ref_learner.policy.state_dict()
    assert all(torch.allclose(a[k], want[k], atol=1e-5) for k in a)
    assert learners[0].version == ITERATIONS


def test_the_averaged_update_is_not_either_trainers_own():
    p = plan()
    learners, groups = run_trainers(p, iterations=1)
    alone = Learner(p)
    alone.warm_up()
    alone.train(groups[0][:4])  # trainer 0's groups without the average
    assert not all(
        torch.allclose(v, learners[0].policy.state_dict()[k], atol=1e-5)
        for k, v in alone.policy.state_dict().items()
    )


def test_a_trainer_that_lost_its_groups_still_steps_with_the_others():
    p = plan()
    learners, groups = run_trainers(p, drop=(1, 1))
    a, b = (lr.policy.state_dict() for lr in learners)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = Learner(p)
    ref.warm_up()
    for t in range(ITERATIONS):
        ref.train(groups[t], replicas=[4, 0] if t == 1 else [4, 4])
    assert all(torch.allclose(a[k], ref.policy.state_dict()[k], atol=1e-5) for k in a)
