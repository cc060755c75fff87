"""Bans of misbehaving peers: points that decay, bans that double and expire, a bounded table, listeners."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError, ErrorCode
from peerd.swarm.bans import GARBAGE_CODES, BanEvent, BanList, BanPolicy, Offence


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


POLICY = BanPolicy(
    threshold=10, garbage_points=4, over_limit_points=1, forgive_per_s=0.1, ban_s=30, max_ban_s=100
)


def test_three_garbage_streams_ban_a_peer_and_only_that_peer():
    clock = Clock()
    bans = BanList(POLICY, clock)
    assert bans.report("p", Offence.GARBAGE) is None
    assert bans.report("p", Offence.GARBAGE) is None
    event = bans.report("p", Offence.GARBAGE, "peerd/probe/1: bad magic")
    assert isinstance(event, BanEvent)
    assert event.peer == "p" and event.duration_s == 30 and event.bans == 1
    assert event.reason == "garbage: peerd/probe/1: bad magic"
    assert bans.remaining("p") == pytest.approx(30)
    assert bans.remaining("q") == 0
    assert bans.banned() == {"p": pytest.approx(30)}


def test_points_are_forgiven_over_time():
    clock = Clock()
    bans = BanList(POLICY, clock)
    for _ in range(20):  # one bad stream every 40 s: forgiven before the next one
        assert bans.report("p", Offence.GARBAGE) is None
        clock.t += 40
    assert bans.remaining("p") == 0 and bans.offences[Offence.GARBAGE] == 20


def test_over_limit_offences_weigh_less():
    clock = Clock()
    bans = BanList(POLICY, clock)
    results = [bans.report("p", Offence.OVER_LIMIT) for _ in range(10)]
    assert results[:9] == [None] * 9 and results[9] is not None


def test_bans_expire_and_each_further_ban_doubles_up_to_the_cap():
    clock = Clock()
    bans = BanList(POLICY, clock)
    lengths = []
    for _ in range(4):
        event = None
        while event is None:
            event = bans.report("p", Offence.GARBAGE)
        lengths.append(event.duration_s)
        assert bans.report("p", Offence.GARBAGE) is None  # offences while banned do not stretch it
        clock.t += event.duration_s
        assert bans.remaining("p") == 0  # expired
    assert lengths == [30, 60, 100, 100]
    clock.t += 101  # good behaviour for max_ban_s: past bans are forgotten
    while (event := bans.report("p", Offence.GARBAGE)) is None:
        pass
    assert event.duration_s == 30 and event.bans == 1


def test_listeners_hear_every_ban_and_a_failing_listener_does_not_stop_it():
    clock = Clock()
    bans = BanList(POLICY, clock)
    heard: list[BanEvent] = []

    def broken(event: BanEvent) -> None:
        raise RuntimeError("listener bug")

    bans.subscribe(broken)
    unsubscribe = bans.subscribe(heard.append)
    for peer in ("a", "b"):
        for _ in range(3):
            bans.report(peer, Offence.GARBAGE)
    assert [e.peer for e in heard] == ["a", "b"] and bans.remaining("b") > 0
    unsubscribe()
    for _ in range(3):
        bans.report("c", Offence.GARBAGE)
    assert len(heard) == 2 and bans.bans_total == 3


def test_the_table_is_bounded_and_keeps_banned_peers_over_strangers():
    clock = Clock()
    bans = BanList(BanPolicy(max_peers=3), clock)
    for _ in range(3):
        bans.report("bad", Offence.GARBAGE)
    assert bans.remaining("bad") > 0
    for stranger in range(100):
        bans.report(stranger, Offence.OVER_LIMIT)
    assert len(bans) == 3
    assert bans.remaining("bad") > 0  # strangers with many identities cannot flush a ban out


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": 0}, "threshold"),
        ({"ban_s": -1}, "ban_s"),
        ({"ban_s": 10, "max_ban_s": 5}, "max_ban_s"),
        ({"max_peers": 0}, "max_peers"),
        ({"forgive_per_s": float("nan")}, "forgive_per_s"),
    ],
)
def test_policy_refuses_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        BanPolicy(**kwargs)
    assert info.value.field == field


def test_a_truncated_frame_is_not_garbage():
    """A peer killed mid-send truncates all its streams at once; that is churn, not misbehaviour."""
    assert ErrorCode.TRUNCATED not in GARBAGE_CODES
    assert {ErrorCode.MALFORMED, ErrorCode.OVERSIZED, ErrorCode.UNKNOWN_KIND} <= GARBAGE_CODES
