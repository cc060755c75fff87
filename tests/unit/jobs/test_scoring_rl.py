"""The rl job's cost model on consensus rosters: roles (one trainer, rollout peers), the RL cost model's time, the island."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from peerd.errors import ConfigError
from peerd.jobs.scoring_rl import RLRosterScorer, rl_workload, roles
from peerd.jobs.spec import parse_job_spec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink

PEERS = [f"Qm{c * 20}" for c in "abcdef"]
RL_JOB: dict[str, Any] = {
    "kind": "rl",
    "model": {"preset": "tiny"},
    "steps": 20,
    "global_batch": 64,
    "micro_batch": 32,
    "min_peers": 3,
    "rl": {"task": {"name": "addition", "max_size": 2}, "group_size": 8, "sampling": {"max_new_tokens": 6}},
}


def roster(
    tflops: list[float],
    bandwidth: list[float | None],
    link_bps: float = 1e9,
    launch: list[float | None] | None = None,
) -> Roster:
    peers = PEERS[: len(tflops)]
    launch = launch or [None] * len(tflops)
    entries = [
        RosterEntry(
            job="j" * 32,
            epoch=0,
            peer=p,
            issued_at=0.0,
            profile=RosterDevice(tflops[i], 8 << 30, "eu", bandwidth[i], launch[i]),
            links=tuple(RosterLink(q, 0.001, link_bps) for q in peers if q > p),
        )
        for i, p in enumerate(peers)
    ]
    return Roster.of(0, entries)


def test_the_workload_is_the_specs_iteration() -> None:
    w = rl_workload(parse_job_spec(RL_JOB))
    assert (w.prompts, w.responses_per_prompt, w.response_len) == (8, 8, 6)
    assert w.optimizer_steps == 2 and w.micro_batch == 32 and w.staleness == 0
    assert w.prompt_len > 0 and w.actor.layers == 2 and w.actor.params > 0
    assert w.constants.weight_bytes == 4.0  # fp32, as the runtime computes


def test_roles_and_their_errors() -> None:
    assert roles(Allocation(((PEERS[0],),), (PEERS[2], PEERS[1]))) == (PEERS[0], (PEERS[1], PEERS[2]))
    with pytest.raises(ConfigError, match="one trainer"):
        roles(Allocation(((PEERS[0], PEERS[1]),), (PEERS[2],)))
    with pytest.raises(ConfigError, match="rollout peer"):
        roles(Allocation(((PEERS[0],),)))


def test_the_fastest_peer_trains_and_more_rollout_peers_generate_faster() -> None:
    spec = parse_job_spec(RL_JOB)
    r = roster([0.05, 0.2, 0.05, 0.05], [5e9] * 4, link_bps=1e11)  # each copy of the weights is cheap
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    best = island.best(1)[0]
    trainer, _ = roles(best)
    assert trainer == PEERS[1]  # 4x the TFLOPS: training is the heavy task
    # a peer re-scoring the candidate gets the island's cost, bit for bit
    assert RLRosterScorer(spec)(r, best) == island.best_cost() == scorer(r, best)
    one = Allocation(((PEERS[1],),), (PEERS[0],))
    assert scorer(r, one) > scorer(r, Allocation(((PEERS[1],),), (PEERS[0], PEERS[2], PEERS[3])))
    parts = scorer.predict(r, best)
    assert set(parts.tasks) == {"generate", "reference", "actor_train"} and parts.sync > 0


def test_generation_is_timed_by_memory_bandwidth() -> None:
    spec = parse_job_spec(RL_JOB)
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    fast = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10]), alloc)
    slow = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e8]), alloc)
    assert slow.tasks["generate"] > fast.tasks["generate"]
    assert slow.tasks["actor_train"] == fast.tasks["actor_train"]


def test_a_peer_that_measured_its_launch_cost_pays_it_per_counted_op() -> None:
    spec = parse_job_spec(RL_JOB)
    ops = rl_workload(spec).launches
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    plain = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10]), alloc)
    # the trainer (PEERS[0]) at 10 µs per op, the rollout peer predating the measurement
    costly = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10], launch=[1e-5, None]), alloc)
    assert costly.tasks["generate"] == plain.tasks["generate"]
    assert costly.tasks["reference"] - plain.tasks["reference"] == pytest.approx(ops.inference * 1e-5)
    updates = ops.train + ops.train_per_micro_batch * 2  # two optimizer steps of one micro-batch each
    assert costly.tasks["actor_train"] - plain.tasks["actor_train"] == pytest.approx(updates * 1e-5)


def test_a_measured_tflops_is_an_achieved_rate_not_a_peak() -> None:
    """The reference pass costs its forward FLOPs at the peer's measured rate (no MFU factor) plus its ops."""
    spec = parse_job_spec(RL_JOB)
    w = rl_workload(spec)
    alloc = Allocation(((PEERS[0],),), (PEERS[1],))
    parts = RLRosterScorer(spec).predict(roster([0.1, 0.1], [1e10, 1e10], launch=[1e-5, 1e-5]), alloc)
    tokens = w.prompts * w.responses_per_prompt * w.seq_len
    assert parts.tasks["reference"] == pytest.approx(
        2 * w.actor.params * tokens / 0.1e12 + w.launches.inference * 1e-5
    )


def test_a_slow_link_makes_a_rollout_peer_not_worth_it() -> None:
    """Weight sync to a rollout peer behind a thin link costs more than its share of generation saves."""
    spec = parse_job_spec(RL_JOB)
    base = roster([0.2, 0.1, 0.1], [5e9] * 3)
    entries = list(base.entries)
    # PEERS[2] reaches the others at 10 kbit/s only
    entries = [
        RosterEntry(
            **{
                **{f: getattr(e, f) for f in e.__struct_fields__},
                "links": tuple(
                    RosterLink(
                        lk.peer, lk.delay_s, 1e4 if PEERS[2] in (e.peer, lk.peer) else lk.bandwidth_bps
                    )
                    for lk in e.links
                ),
            }
        )
        for e in entries
    ]
    r = Roster.of(0, entries)
    scorer = RLRosterScorer(spec)
    island = scorer.island(scorer.scenario(r), seed=0, time_budget=1.0)
    island.step(5)
    trainer, rollouts = roles(island.best(1)[0])
    assert PEERS[2] not in (trainer, *rollouts)


def test_a_roster_without_memory_bandwidth_cannot_be_scored() -> None:
    spec = parse_job_spec(RL_JOB)
    r = roster([0.1, 0.1], [5e9, None])
    with pytest.raises(ConfigError) as err:
        RLRosterScorer(spec)(r, Allocation(((PEERS[0],),), (PEERS[1],)))
    assert err.value.field == "roster.entries[1].profile.memory_bandwidth"


def test_a_pretrain_spec_has_no_rl_workload() -> None:
    data = copy.deepcopy(RL_JOB)
    data.update(kind="pretrain", min_peers=1)
    del data["rl"]
    with pytest.raises(ConfigError):
        rl_workload(parse_job_spec(data))
