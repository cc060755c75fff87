"""``planning.placement: random`` through the real planning driver: every peer commits the seeded baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from peerd.jobs.spec import JobSpecError, parse_job_spec
from peerd.sched.placement import placement_seed, random_allocation
from peerd.sched.problem import Shape

_spec = importlib.util.spec_from_file_location("planner_swarm", Path(__file__).with_name("test_planner.py"))
planner_swarm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(planner_swarm)  # type: ignore[union-attr]
Swarm, T0 = planner_swarm.Swarm, planner_swarm.T0


def random_spec(seed: int, d_pp: int | str = 3, d_dp: int | str = 2):
    return parse_job_spec(
        {
            "name": "offline-random",
            "kind": "pretrain",
            "model": {"preset": "tiny"},
            "steps": 10,
            "global_batch": 16,
            "micro_batch": 4,
            "data": {"seq_len": 32},
            "parallel": {"d_pp": d_pp, "d_dp": d_dp},
            "min_peers": 6,
            "planning": {
                "time_budget_s": 2.0,
                "max_skew_s": 0.6,
                "placement": "random",
                "placement_seed": seed,
            },
        }
    )


@pytest.mark.parametrize("seed", [0, 5])
def test_every_peer_commits_the_seeded_random_allocation(seed: int) -> None:
    swarm = Swarm(6, job_spec=random_spec(seed), miss=0.3, seed=seed)
    try:
        planner_swarm.run(swarm.run(T0 + 60))
        commits = {p: c[-1] for p, c in swarm.commits.items() if c}
        assert len(commits) == 6, f"not every peer committed: {list(commits)}"
        assert len({c.allocation_hash for c in commits.values()}) == 1
        commit = next(iter(commits.values()))
        expected = random_allocation(swarm.peers, Shape(3, 2), placement_seed(swarm.job.job_id, seed))
        assert commit.allocation.canonical() == expected.canonical()
        assert all(not pl.islands for pl in swarm.planners.values())  # no search ran
    finally:
        swarm.close()


def test_random_placement_needs_a_fixed_shape() -> None:
    with pytest.raises(JobSpecError, match=r"planning\.placement"):
        random_spec(0, d_pp="auto")
    assert (
        parse_job_spec(
            {"kind": "pretrain", "model": {"preset": "tiny"}, "steps": 1, "global_batch": 1, "micro_batch": 1}
        ).planning.placement
        == "search"
    )
    with pytest.raises(JobSpecError, match="placement"):
        parse_job_spec(
            {
                "kind": "pretrain",
                "model": {"preset": "tiny"},
                "steps": 1,
                "global_batch": 1,
                "micro_batch": 1,
                "planning": {"placement": "megatron"},
            }
        )
