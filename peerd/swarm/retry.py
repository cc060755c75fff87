"""Retry bookkeeping for remote calls: capped, jittered backoff and temporary bans of failing peers.

Pure and clock-injected (style.md principle 7); ``Transport.connect`` applies it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peerd.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard ``connect`` tries before giving up on a peer, and how long it then leaves the peer alone."""

    attempts: int = 3
    """Stream-open attempts per ``connect`` call (all within its timeout)."""
    base_backoff_s: float = 0.2
    """Pause after the first failed attempt; doubles per attempt (with jitter)."""
    max_backoff_s: float = 2.0
    """Cap on one pause."""
    ban_after_failures: int = 3
    """Consecutive failed ``connect`` calls before the peer is banned."""
    ban_s: float = 15.0
    """First ban length; doubles for each further ban."""
    max_ban_s: float = 300.0
    """Cap on one ban."""


@dataclass
class _PeerRecord:
    failures: int = 0
    bans: int = 0
    banned_until: float = 0.0


class PeerBans:
    """Pure bookkeeping of failing peers: consecutive failures, temporary bans, backoff delays."""

    def __init__(
        self,
        policy: RetryPolicy,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.policy = policy
        self._clock = clock
        self._rng = rng or random.Random()
        self._peers: dict[Any, _PeerRecord] = {}

    def remaining(self, peer: Any) -> float:
        """Seconds left on ``peer``'s ban (0 when not banned)."""
        record = self._peers.get(peer)
        return 0.0 if record is None else max(0.0, record.banned_until - self._clock())

    def failed(self, peer: Any) -> None:
        record = self._peers.setdefault(peer, _PeerRecord())
        record.failures += 1
        if record.failures >= self.policy.ban_after_failures:
            length = min(self.policy.max_ban_s, self.policy.ban_s * 2**record.bans)
            record.banned_until = self._clock() + length
            record.bans += 1
            record.failures = 0
            logger.warning("peer %s banned for %.0f s after repeated connect failures", peer, length)

    def succeeded(self, peer: Any) -> None:
        self._peers.pop(peer, None)

    def backoff(self, attempt: int) -> float:
        """Pause after failed attempt number ``attempt`` (0-based): capped exponential, jittered to 50-100 %."""
        cap = min(self.policy.max_backoff_s, self.policy.base_backoff_s * 2**attempt)
        return cap * self._rng.uniform(0.5, 1.0)
