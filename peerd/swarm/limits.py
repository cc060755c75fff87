"""Per-peer resource limits of served streams: stream slots, byte budgets (token buckets) in bounded tables.

Pure and clock-injected: ``Transport`` applies ``StreamLimits`` with ``StreamSlots`` to every
protocol it serves, and handlers that answer small requests with many bytes (link probes)
charge what they send to a ``ByteBudget``. Every table here is bounded, so a swarm of
strangers cannot make it grow without end (protocols/transport.md, "Limits").
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from peerd.errors import ConfigError, ErrorCode, PeerUnavailable


@dataclass(frozen=True)
class StreamLimits:
    """What one served protocol grants each peer and all peers together."""

    max_per_peer: int = 16
    """Concurrent streams one peer may hold open on this protocol; more are refused with RATE_LIMITED."""
    max_total: int = 256
    """Concurrent streams of all peers together on this protocol; more are refused with BUSY."""
    idle_timeout_s: float | None = None
    """Longest a served stream waits for the remote (a frame to start or progress, a write to drain);
    caps the handler's own timeouts. None: the handler's timeouts alone apply."""
    session_timeout_s: float | None = None
    """Longest one served stream may stay open in total, however busy; then it ends with TIMEOUT.
    None: no limit (persistent streams, e.g. between pipeline neighbours)."""

    def __post_init__(self) -> None:
        for name in ("max_per_peer", "max_total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        if self.max_per_peer > self.max_total:
            raise ConfigError("max_per_peer", f"{self.max_per_peer} > max_total {self.max_total}")
        for name in ("idle_timeout_s", "session_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ConfigError(name, f"must be a finite number > 0 or None, got {value!r}")


DEFAULT_STREAM_LIMITS = StreamLimits()
# A protocol without an allow-list can be opened by any stranger: fewer streams per peer, and a
# stream that waits on its remote for a minute is over (it would otherwise hold its slot forever).
OPEN_STREAM_LIMITS = StreamLimits(max_per_peer=8, max_total=128, idle_timeout_s=60.0)


class StreamSlots:
    """Counts the open streams of one protocol per peer; only peers holding a slot are stored (<= max_total)."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self._held: dict[Hashable, int] = {}
        self.total = 0
        self.refused = 0

    def held(self, peer: Hashable) -> int:
        return self._held.get(peer, 0)

    def acquire(self, peer: Hashable) -> None:
        """Take a slot for ``peer`` or raise PeerUnavailable (RATE_LIMITED: this peer's share; BUSY: everyone's)."""
        mine = self._held.get(peer, 0)
        if mine >= self.limits.max_per_peer:
            self.refused += 1
            raise PeerUnavailable(
                f"this peer already holds {mine} streams (at most {self.limits.max_per_peer} per peer)",
                code=ErrorCode.RATE_LIMITED,
            )
        if self.total >= self.limits.max_total:
            self.refused += 1
            raise PeerUnavailable(
                f"serving {self.total} streams (at most {self.limits.max_total})", code=ErrorCode.BUSY
            )
        self._held[peer] = mine + 1
        self.total += 1

    def release(self, peer: Hashable) -> None:
        mine = self._held.get(peer, 0)
        assert mine > 0, "released a slot that was not held"
        if mine == 1:
            del self._held[peer]
        else:
            self._held[peer] = mine - 1
        self.total -= 1


class Bucket:
    """A token bucket of bytes that may run into debt: ``take`` always succeeds, ``grant`` says what is left."""

    def __init__(self, rate_Bps: float, burst_bytes: float, now: float) -> None:
        self.rate_Bps = rate_Bps
        self.burst_bytes = burst_bytes
        self._tokens = float(burst_bytes)
        self._stamp = now

    def tokens(self, now: float) -> float:
        if now > self._stamp:
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self.rate_Bps)
            self._stamp = now
        return self._tokens

    def take(self, nbytes: float, now: float) -> None:
        self._tokens = self.tokens(now) - nbytes

    def full(self, now: float) -> bool:
        return self.tokens(now) >= self.burst_bytes

    def seconds_until(self, nbytes: float, now: float) -> float:
        """How long until ``nbytes`` tokens are available (0 when they are)."""
        missing = min(nbytes, self.burst_bytes) - self.tokens(now)
        return max(0.0, missing / self.rate_Bps)


@dataclass(frozen=True)
class BudgetConfig:
    """Bytes a server may send in answers: per peer, and for all peers together (the uplink's share)."""

    rate_Bps: float
    """Sustained bytes per second per peer."""
    burst_bytes: float
    """Bytes a peer may get at once after a quiet while."""
    total_rate_Bps: float
    """Sustained bytes per second for all peers together (strangers with many identities)."""
    total_burst_bytes: float
    max_peers: int = 4096
    """Peers tracked at once; the table forgets the least recently seen first (a full bucket loses nothing)."""

    def __post_init__(self) -> None:
        for name in ("rate_Bps", "burst_bytes", "total_rate_Bps", "total_burst_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a finite number > 0, got {value!r}")
        if not isinstance(self.max_peers, int) or self.max_peers < 1:
            raise ConfigError("max_peers", f"must be an int >= 1, got {self.max_peers!r}")


class ByteBudget:
    """Per-peer and total token buckets of answer bytes, in a table bounded by ``max_peers`` (LRU)."""

    def __init__(self, config: BudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._peers: OrderedDict[Hashable, Bucket] = OrderedDict()
        self.total = Bucket(config.total_rate_Bps, config.total_burst_bytes, clock())
        self.refused = 0

    def __len__(self) -> int:
        return len(self._peers)

    def _bucket(self, peer: Hashable, now: float) -> Bucket:
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = Bucket(self.config.rate_Bps, self.config.burst_bytes, now)
            # forget full buckets first (no information lost), then the least recently seen
            while len(self._peers) > self.config.max_peers:
                victim = next((p for p, b in self._peers.items() if b.full(now) and p != peer), None)
                if victim is None:
                    victim = next(iter(self._peers))
                del self._peers[victim]
        else:
            self._peers.move_to_end(peer)
        return bucket

    def available(self, peer: Hashable) -> float:
        now = self._clock()
        return max(0.0, min(self._bucket(peer, now).tokens(now), self.total.tokens(now)))

    def grant(self, peer: Hashable, want: int, at_least: int = 1) -> int:
        """Bytes (<= ``want``) that ``peer`` may get now; raise RATE_LIMITED when fewer than ``at_least``.

        The caller charges what it really sent with ``charge``.
        """
        now = self._clock()
        bucket = self._bucket(peer, now)
        left = int(max(0.0, min(bucket.tokens(now), self.total.tokens(now))))
        if left < min(want, at_least):
            self.refused += 1
            wait = max(bucket.seconds_until(at_least, now), self.total.seconds_until(at_least, now))
            raise PeerUnavailable(
                f"answer byte budget spent (at most {self.config.burst_bytes:.0f} B at once, "
                f"{self.config.rate_Bps:.0f} B/s per peer); retry in {wait:.1f} s",
                code=ErrorCode.RATE_LIMITED,
            )
        return min(want, left)

    def wait_s(self, peer: Hashable, nbytes: int) -> float:
        """Seconds until ``peer`` may be sent ``nbytes`` (0: now), by its own and the shared bucket."""
        now = self._clock()
        return max(self._bucket(peer, now).seconds_until(nbytes, now), self.total.seconds_until(nbytes, now))

    def charge(self, peer: Hashable, nbytes: int) -> None:
        """Count ``nbytes`` sent to ``peer`` (may leave the bucket in debt: later grants wait it off)."""
        now = self._clock()
        self._bucket(peer, now).take(nbytes, now)
        self.total.take(nbytes, now)
