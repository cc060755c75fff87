"""The rl job's pure plan: sizes from the spec, problems and sampling seeds any peer can compute, shards."""

from __future__ import annotations

import pytest
import torch

from peerd.jobs.rl.shards import RLPlan, Shard, assign_shards, shard_ranges
from peerd.jobs.spec import parse_job_spec


def plan(**changes) -> RLPlan:
    spec = {
        "kind": "rl",
        "name": "plan",
        "model": {"preset": "tiny", "seed": 5},
        "steps": 10,
        "global_batch": 48,
        "micro_batch": 16,
        "min_peers": 3,
        "rl": {"group_size": 8, "epochs": 2, "task": {"name": "sorting", "min_size": 2, "max_size": 4}},
    }
    spec.update(changes)
    return RLPlan("ab" * 16, parse_job_spec(spec))


def test_sizes_are_the_spec_read_as_an_rl_job():
    p = plan()
    assert (p.iterations, p.group_size, p.prompts) == (10, 8, 6)
    assert (p.groups_per_update, p.updates_per_iteration, p.total_updates) == (2, 3, 10 * 2 * 3)
    assert (p.seed, p.vocab_size, p.max_new_tokens) == (5, 256, 8)


@pytest.mark.parametrize(("prompts", "shards"), [(6, 2), (7, 3), (2, 5), (16, 1)])
def test_shards_tile_the_prompts_contiguously(prompts: int, shards: int):
    ranges = shard_ranges(prompts, shards)
    assert len(ranges) == shards
    assert [i for r in ranges for i in r] == list(range(prompts))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_one_trainers_shard_i_is_the_ith_rollout_peer_by_sorted_id():
    shards = assign_shards(7, 1, ["Qmc", "Qma", "Qmb"])
    assert [s.sampler for s in shards] == ["Qma", "Qmb", "Qmc"]
    assert [s.problems for s in shards] == shard_ranges(7, 3)
    assert [(s.index, s.trainer) for s in shards] == [(0, 0), (1, 0), (2, 0)]


def test_rollout_peers_are_dealt_round_robin_over_the_trainers():
    shards = assign_shards(12, 2, ["Qmd", "Qmb", "Qma"])
    assert shards == [
        Shard(0, 0, "Qma", range(0, 3)),
        Shard(1, 0, "Qmd", range(3, 6)),
        Shard(2, 1, "Qmb", range(6, 12)),
    ]


@pytest.mark.parametrize(("prompts", "trainers", "peers"), [(8, 4, 0), (8, 2, 1), (9, 3, 5), (4, 1, 0)])
def test_a_trainer_without_rollout_peers_samples_its_range_itself(prompts: int, trainers: int, peers: int):
    shards = assign_shards(prompts, trainers, [f"Qm{i}" for i in range(peers)])
    assert [i for s in shards for i in s.problems] == list(range(prompts))  # tiled, in shard order
    assert [s.index for s in shards] == list(range(len(shards)))
    owned = shard_ranges(prompts, trainers)
    for r in range(trainers):
        mine = [s for s in shards if s.trainer == r]
        assert [i for s in mine for i in s.problems] == list(owned[r])
        assert (len(mine) == 1 and mine[0].sampler is None) == (r >= peers)


def test_problems_and_generators_depend_on_seed_iteration_and_index_only():
    a, b, other = plan(), plan(), plan(model={"preset": "tiny", "seed": 6})
    assert a.problems(3, range(6)) == b.problems(3, range(6))
    assert a.problem(3, 4) == b.problems(3, range(6))[4]  # any shard computes its own problems alone
    assert a.problems(3, range(6)) != a.problems(4, range(6))
    assert a.problems(3, range(6)) != other.problems(3, range(6))
    draw = [
        torch.rand(4, generator=p.generator(t, s)) for p, t, s in [(a, 1, 0), (b, 1, 0), (a, 1, 1), (a, 2, 0)]
    ]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2]) and not torch.equal(draw[0], draw[3])


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": True}])
def test_the_weights_bound_holds_the_packed_weights(overrides: dict):
    from peerd.jobs.rl.learner import Learner
    from peerd.rl.weights import pack_weights

    p = plan(model={"preset": "tiny", "seed": 5, "overrides": overrides})
    blob = pack_weights(0, Learner(p).weights())
    assert len(blob) <= p.weights_bound < 4 * len(blob) + (1 << 20)
