"""The staleness buffer: rollouts within k versions pass, older ones are dropped and counted."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError, ProtocolError
from peerd.rl.buffer import RolloutBuffer
from peerd.rl.rollout import RolloutGroup
from peerd.rl.tasks import Problem


def _group(version: int) -> RolloutGroup:
    return RolloutGroup(Problem("1+1=", "2"), [[50, 10]], [[-0.1, -0.2]], version)


def test_sync_mode_takes_only_the_current_version():
    buf = RolloutBuffer(staleness=0)
    assert buf.add([_group(5), _group(4), _group(5)], version=5) == 2
    assert [g.version for g in buf.take(10, version=5)] == [5, 5]
    assert buf.stats.dropped_on_arrival == 1 and buf.stats.taken == 2
    assert buf.stats.staleness == {0: 2}


def test_async_bound_k_on_arrival_and_while_waiting():
    buf = RolloutBuffer(staleness=2)
    assert buf.add([_group(v) for v in (8, 6, 9, 10, 7)], version=10) == 3  # 6 and 7 are > 2 behind
    # the trainer moves to 11 before taking: version 8 is now 3 behind
    taken = buf.take(2, version=11)
    assert [g.version for g in taken] == [9, 10]  # 8 dropped on the way, FIFO otherwise
    assert buf.stats.dropped_waiting == 1 and buf.stats.dropped == 3
    assert all(11 - g.version <= 2 for g in taken)
    assert buf.stats.staleness == {2: 1, 1: 1}
    assert len(buf) == 0


def test_take_stops_at_n_and_keeps_the_rest():
    buf = RolloutBuffer(staleness=1)
    buf.add([_group(3) for _ in range(5)], version=3)
    assert len(buf.take(2, version=3)) == 2
    assert len(buf) == 3
    assert len(buf.take(10, version=4)) == 3


def test_rollouts_from_the_future_and_negative_bounds_are_refused():
    buf = RolloutBuffer(staleness=1)
    with pytest.raises(ProtocolError, match="ahead"):
        buf.add([_group(4)], version=3)
    with pytest.raises(ConfigError) as exc:
        RolloutBuffer(staleness=-1)
    assert exc.value.field == "staleness"
