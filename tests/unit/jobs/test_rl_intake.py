"""The trainer's intake of rollout shards: taken, turned down (late, stale, duplicate), refused, waited for."""

from __future__ import annotations

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.rl.intake import Intake
from peerd.jobs.rl.messages import RolloutBounds, RolloutGroupWire, Rollouts

PEERS = ["Qma", "Qmb"]
BOUNDS = RolloutBounds(
    iterations=10, shards=[range(0, 2), range(2, 4)], group_size=2, max_new_tokens=3, vocab_size=256
)


def shard(iteration: int, s: int, version: int) -> Rollouts:
    groups = [
        RolloutGroupWire(problem=i, completions=[[49, 10], [50, 10]], logprobs=[[-1.0, -0.5], [-2.0, -0.1]])
        for i in BOUNDS.shards[s]
    ]
    return Rollouts(iteration=iteration, shard=s, version=version, groups=groups)


def intake(staleness: int = 1, *, iteration: int = 3, version: int = 3) -> Intake:
    return Intake(dict(enumerate(PEERS)), BOUNDS, staleness, iteration=iteration, version=version)


def test_a_fresh_shard_is_taken_once():
    box = intake()
    ack = box.take("Qmb", shard(3, 1, 3))
    assert ack.accepted and ack.version == 3 and not ack.reason
    again = box.take("Qmb", shard(3, 1, 2))
    assert not again.accepted and again.reason == "duplicate shard" and box.duplicates == 1
    assert set(box.arrived[3]) == {1} and box.arrived[3][1].version == 3


def test_late_and_stale_shards_are_turned_down_and_counted():
    box = intake(staleness=1)
    late = box.take("Qma", shard(2, 0, 2))
    stale = box.take("Qma", shard(4, 0, 2))  # iteration 4 sampled by version 2: two behind
    assert not late.accepted and "trained already" in late.reason
    assert not stale.accepted and "behind" in stale.reason
    assert (box.dropped_late, box.dropped_stale) == (4, 4)
    assert not any(box.arrived.values())


@pytest.mark.parametrize(
    ("peer", "msg", "code"),
    [
        ("Qmb", shard(3, 0, 3), ErrorCode.NOT_ALLOWED),  # another peer's shard
        ("Qma", shard(3, 0, 4), ErrorCode.FROM_FUTURE),  # a version the trainer has not published
        ("Qma", shard(5, 0, 3), ErrorCode.WRONG_STEP),  # more than staleness ahead of the iteration
        ("Qma", shard(10, 0, 3), ErrorCode.WRONG_STEP),  # beyond the job
    ],
)
def test_what_no_healthy_peer_sends_is_refused(peer: str, msg: Rollouts, code: ErrorCode):
    box = intake(staleness=1)
    with pytest.raises(ProtocolError) as info:
        box.take(peer, msg)
    assert info.value.code == code and not any(box.arrived.values())


def test_closing_an_iteration_marks_the_missing_peers_absent_until_they_deliver():
    box = intake(staleness=0)
    box.take("Qma", shard(3, 0, 3))
    assert not box.complete(3)
    shards, missing = box.close(3)
    assert list(shards) == [0] and missing == [1] and box.absent == {1} and box.missing_shards == 1
    assert box.iteration == 4 and box.expected() == {0}  # shard 1 is not waited for any more
    assert not box.take("Qma", shard(3, 0, 3)).accepted  # late now
    box.version = 4
    assert not box.take("Qmb", shard(3, 1, 3)).accepted  # its late shard of 3 comes in at last:
    assert box.absent == set() and box.expected() == {0, 1}  # it is alive, and waited for again
    box.absent.add(1)
    assert box.take("Qmb", shard(4, 1, 4)).accepted and box.absent == set()
    assert not box.complete(4)  # delivering again, it is waited for like any peer
    box.take("Qma", shard(4, 0, 4))
    assert box.complete(4)


def test_shards_owed_by_peers_that_left_the_swarm_are_not_waited_for():
    box = intake(staleness=0)
    box.take("Qma", shard(3, 0, 3))
    assert box.give_up(3, {"Qma", "Qmz"}) == []  # Qma delivered already; Qmz owes nothing
    assert box.give_up(3, {"Qmb"}) == [1] and box.complete(3)  # nothing else to wait for
    assert box.absent == {1} and box.missing_shards == 1
    shards, missing = box.close(3)
    assert list(shards) == [0] and missing == [] and box.missing_shards == 1


def test_status_says_not_ready_before_the_first_version():
    box = intake(version=-1)
    assert not box.status().ready
    box.version = 0
    assert box.status().ready and box.status().version == 0


def test_the_slowest_shards_sampling_is_the_iterations_generation_time() -> None:
    from peerd.jobs.rl.messages import Rollouts
    from peerd.jobs.rl.trainer import generation_seconds

    def shard(k: int, sample_s: float | None) -> Rollouts:
        return Rollouts(iteration=0, shard=k, version=0, groups=[], sample_s=sample_s)

    assert generation_seconds({0: shard(0, 0.004), 1: shard(1, 0.007), 2: shard(2, None)}) == {
        "generate": 0.007
    }
    assert generation_seconds({0: shard(0, None)}) == {}
