"""Connect retry bookkeeping: capped jittered backoff, temporary bans that grow and expire, reset on success."""

from __future__ import annotations

import random

import pytest

from peerd.swarm.retry import PeerBans, RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_doubles_is_capped_and_jittered():
    bans = PeerBans(RetryPolicy(base_backoff_s=0.2, max_backoff_s=1.0), rng=random.Random(0))
    for attempt, cap in [(0, 0.2), (1, 0.4), (2, 0.8), (3, 1.0), (10, 1.0)]:
        pauses = [bans.backoff(attempt) for _ in range(50)]
        assert all(cap * 0.5 <= p <= cap for p in pauses)
        assert max(pauses) - min(pauses) > 0.1 * cap  # jitter spreads retries of many peers


def test_ban_after_consecutive_failures_then_expiry_and_growth():
    clock = Clock()
    bans = PeerBans(RetryPolicy(ban_after_failures=3, ban_s=10.0, max_ban_s=25.0), clock=clock)
    bans.failed("p")
    bans.failed("p")
    assert bans.remaining("p") == 0.0
    bans.failed("p")
    assert bans.remaining("p") == pytest.approx(10.0)
    assert bans.remaining("q") == 0.0  # bans are per peer
    clock.t += 10.0
    assert bans.remaining("p") == 0.0
    for _ in range(3):
        bans.failed("p")
    assert bans.remaining("p") == pytest.approx(20.0)  # second ban is twice as long
    clock.t += 20.0
    for _ in range(3):
        bans.failed("p")
    assert bans.remaining("p") == pytest.approx(25.0)  # capped


def test_success_forgets_the_history():
    clock = Clock()
    bans = PeerBans(RetryPolicy(ban_after_failures=2, ban_s=10.0), clock=clock)
    bans.failed("p")
    bans.succeeded("p")
    bans.failed("p")
    assert bans.remaining("p") == 0.0
