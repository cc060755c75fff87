"""Per-peer limits: stream slots per peer and in total, token buckets with debt, a bounded per-peer budget table."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError, ErrorCode, PeerUnavailable
from peerd.swarm.limits import Bucket, BudgetConfig, ByteBudget, StreamLimits, StreamSlots


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_per_peer": 0}, "max_per_peer"),
        ({"max_total": 0}, "max_total"),
        ({"max_per_peer": 5, "max_total": 4}, "max_per_peer"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"session_timeout_s": float("inf")}, "session_timeout_s"),
        ({"session_timeout_s": -1.0}, "session_timeout_s"),
    ],
)
def test_stream_limits_refuse_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        StreamLimits(**kwargs)
    assert info.value.field == field


def test_slots_cap_each_peer_and_everyone_with_distinct_codes():
    slots = StreamSlots(StreamLimits(max_per_peer=2, max_total=3))
    slots.acquire("a")
    slots.acquire("a")
    with pytest.raises(PeerUnavailable) as mine:
        slots.acquire("a")
    assert mine.value.code == ErrorCode.RATE_LIMITED  # a's own share
    slots.acquire("b")
    with pytest.raises(PeerUnavailable) as everyone:
        slots.acquire("c")
    assert everyone.value.code == ErrorCode.BUSY  # nobody's fault in particular
    assert slots.total == 3 and slots.refused == 2
    slots.release("a")
    slots.acquire("c")
    for peer in ("a", "b", "c"):
        slots.release(peer)
    assert slots.total == 0 and slots.held("a") == 0
    assert not slots._held  # only peers holding a slot are stored


def test_bucket_refills_up_to_its_burst_and_carries_debt():
    bucket = Bucket(rate_Bps=100.0, burst_bytes=1000.0, now=0.0)
    bucket.take(1500, now=0.0)
    assert bucket.tokens(0.0) == -500
    assert bucket.seconds_until(100, 0.0) == pytest.approx(6.0)
    assert bucket.tokens(20.0) == 1000  # never above the burst
    assert bucket.full(20.0)


def budget(clock: Clock, **overrides) -> ByteBudget:
    config = {
        "rate_Bps": 100.0,
        "burst_bytes": 1000.0,
        "total_rate_Bps": 1e9,
        "total_burst_bytes": 1e9,
        **overrides,
    }
    return ByteBudget(BudgetConfig(**config), clock)


def test_grants_shrink_to_what_is_left_then_refuse_with_rate_limited():
    clock = Clock()
    b = budget(clock)
    assert b.grant("a", 600) == 600
    b.charge("a", 600)
    assert b.grant("a", 600) == 400  # clipped, not refused
    b.charge("a", 400)
    with pytest.raises(PeerUnavailable) as info:
        b.grant("a", 600, at_least=50)
    assert info.value.code == ErrorCode.RATE_LIMITED and "retry in 0.5 s" in str(info.value)
    assert b.grant("b", 600) == 600  # budgets are per peer
    clock.t += 2.0
    assert b.grant("a", 600) == 200  # refilled at rate_Bps
    assert b.refused == 1


def test_the_shared_budget_bounds_many_identities_together():
    clock = Clock()
    b = budget(clock, total_rate_Bps=10.0, total_burst_bytes=1500.0)
    sent = 0
    for peer in range(10):
        try:
            got = b.grant(peer, 1000, at_least=100)
        except PeerUnavailable:
            continue
        b.charge(peer, got)
        sent += got
    assert sent == 1500


def test_the_peer_table_is_bounded_and_forgets_full_buckets_first():
    clock = Clock()
    b = budget(clock, max_peers=3)
    b.charge("drained", 900)
    for peer in ("x", "y", "z", "w"):
        b.available(peer)  # touching a peer creates its (full) bucket
    assert len(b) == 3
    assert b.available("drained") == pytest.approx(100.0)  # kept: its debt is information
    assert len(b) == 3


@pytest.mark.parametrize("field", ["rate_Bps", "burst_bytes", "total_rate_Bps", "total_burst_bytes"])
def test_budget_config_refuses_non_positive_values(field):
    values = {"rate_Bps": 1.0, "burst_bytes": 1.0, "total_rate_Bps": 1.0, "total_burst_bytes": 1.0}
    with pytest.raises(ConfigError) as info:
        BudgetConfig(**{**values, field: 0.0})
    assert info.value.field == field


@pytest.mark.parametrize("code", [ErrorCode.RATE_LIMITED, ErrorCode.BANNED])
def test_refusal_codes_from_the_remote_come_out_as_peer_unavailable(code):
    from peerd.swarm.framing import error_from_header, error_header

    exc = error_from_header(error_header(code, "later"))
    assert isinstance(exc, PeerUnavailable) and exc.code == code


def test_wait_s_is_the_time_until_both_buckets_cover_the_bytes_and_queues_charged_debt():
    clock = Clock()
    b = budget(clock, total_rate_Bps=50.0, total_burst_bytes=5000.0)
    assert b.wait_s("a", 1000) == 0.0
    b.charge("a", 1000)  # the burst spent
    assert b.wait_s("a", 100) == pytest.approx(1.0)  # 100 B at 100 B/s
    b.charge("a", 100)  # charged before its wait: in debt
    assert b.wait_s("a", 100) == pytest.approx(2.0)  # queued behind the first
    assert b.wait_s("b", 100) == 0.0  # another peer: its own bucket, the shared one still has 3900 B
    b.charge("b", 3900)
    assert b.wait_s("c", 100) == pytest.approx(2.0)  # a fresh peer waits on the shared bucket (50 B/s)
