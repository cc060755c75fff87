"""Temporary bans of misbehaving peers: offence points that decay, bans that grow, a bounded table, listeners.

Pure and clock-injected. ``Transport`` reports an offence when a peer's stream carries
garbage (bytes or messages that fail to decode) or exceeds its limits (streams, bytes,
session time); enough points in a short while ban the peer, and its streams are refused
with BANNED until the ban ends. Each further ban of the same peer lasts twice as long.
Listeners (the churn detector, status) learn of every ban through ``subscribe``.
"""

from __future__ import annotations

import enum
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from peerd.errors import ConfigError, ErrorCode
from peerd.log import get_logger

logger = get_logger(__name__)


class Offence(enum.Enum):
    GARBAGE = "garbage"  # a frame or message that failed to decode, or of an unknown kind
    OVER_LIMIT = "over_limit"  # more streams, bytes or session time than its share


# the codes of a handler's error that mean "the remote sent garbage" (protocols/error-codes.md 1xx);
# not TRUNCATED: a stream that ends inside a frame is what a peer killed mid-send looks like, and
# one kill cuts several streams at once (its restart must not find itself banned)
GARBAGE_CODES = frozenset(
    {
        ErrorCode.MALFORMED,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.UNKNOWN_KIND,
        ErrorCode.OVERSIZED,
    }
)


@dataclass(frozen=True)
class BanPolicy:
    """When a misbehaving peer is banned, and for how long."""

    threshold: float = 10.0
    """Offence points that ban a peer."""
    garbage_points: float = 4.0
    """Points per stream that carried garbage (3 in a short while ban)."""
    over_limit_points: float = 1.0
    """Points per refusal or cut for exceeding a limit (10 in a short while ban)."""
    forgive_per_s: float = 0.1
    """Points forgiven per second: a peer with one bad stream every 40 s is never banned."""
    ban_s: float = 30.0
    """Length of a peer's first ban; each further ban doubles it."""
    max_ban_s: float = 3600.0
    """Cap on one ban; also how long a peer's past bans are remembered after its last one ended."""
    max_peers: int = 4096
    """Peers tracked at once; the table forgets peers that are not banned first, oldest first."""

    def __post_init__(self) -> None:
        for name in (
            "threshold",
            "garbage_points",
            "over_limit_points",
            "forgive_per_s",
            "ban_s",
            "max_ban_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a finite number > 0, got {value!r}")
        if self.max_ban_s < self.ban_s:
            raise ConfigError("max_ban_s", f"must be >= ban_s ({self.ban_s})")
        if not isinstance(self.max_peers, int) or self.max_peers < 1:
            raise ConfigError("max_peers", f"must be an int >= 1, got {self.max_peers!r}")

    def points(self, offence: Offence) -> float:
        return self.garbage_points if offence is Offence.GARBAGE else self.over_limit_points


@dataclass(frozen=True)
class BanEvent:
    """A peer was just banned: who, why, for how long (``until`` on the ban list's monotonic clock)."""

    peer: Hashable
    reason: str
    duration_s: float
    until: float
    bans: int
    """How many times this peer has been banned (this one included)."""


Listener = Callable[[BanEvent], None]


@dataclass
class _Record:
    points: float = 0.0
    stamp: float = 0.0  # when ``points`` was last brought up to date
    bans: int = 0
    banned_until: float = 0.0


class BanList:
    """Offence points and bans per peer; ``remaining(peer)`` > 0 while a peer is banned."""

    def __init__(self, policy: BanPolicy = BanPolicy(), clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._peers: OrderedDict[Hashable, _Record] = OrderedDict()
        self._listeners: list[Listener] = []
        self.offences: dict[Offence, int] = {o: 0 for o in Offence}
        self.bans_total = 0

    def __len__(self) -> int:
        return len(self._peers)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` on every new ban (in the reporting task; keep it quick); returns an unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def remaining(self, peer: Hashable) -> float:
        """Seconds left on ``peer``'s ban (0 when not banned)."""
        record = self._peers.get(peer)
        return 0.0 if record is None else max(0.0, record.banned_until - self._clock())

    def banned(self) -> dict[Hashable, float]:
        """The peers banned now, with the seconds left on each ban."""
        now = self._clock()
        return {p: r.banned_until - now for p, r in self._peers.items() if r.banned_until > now}

    def report(self, peer: Hashable, offence: Offence, detail: str = "") -> BanEvent | None:
        """Count one offence of ``peer``; returns the ban it caused, if it caused one.

        Offences while a peer is banned are not counted (it is refused before it can commit
        any, and its retries must not stretch the ban).
        """
        now = self._clock()
        record = self._record(peer, now)
        if record.banned_until > now:
            return None
        self.offences[offence] += 1
        policy = self.policy
        record.points = self._decayed(record, now) + policy.points(offence)
        record.stamp = now
        if record.points < policy.threshold:
            return None
        record.points = 0.0
        record.bans += 1
        length = min(policy.max_ban_s, policy.ban_s * 2 ** (record.bans - 1))
        record.banned_until = now + length
        self.bans_total += 1
        event = BanEvent(
            peer, f"{offence.value}: {detail}" if detail else offence.value, length, now + length, record.bans
        )
        logger.warning("banned peer %s for %.0f s (ban %d): %s", peer, length, record.bans, event.reason)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a listener's bug must not let the offender in
                logger.exception("a ban listener failed")
        return event

    def _decayed(self, record: _Record, now: float) -> float:
        return max(0.0, record.points - (now - record.stamp) * self.policy.forgive_per_s)

    def _record(self, peer: Hashable, now: float) -> _Record:
        record = self._peers.get(peer)
        if record is not None:
            self._peers.move_to_end(peer)
            if record.bans and record.banned_until + self.policy.max_ban_s < now:
                record.bans = 0  # good behaviour for max_ban_s after its last ban: a fresh start
            return record
        record = self._peers[peer] = _Record(stamp=now)
        if len(self._peers) > self.policy.max_peers:
            self._evict(now, keep=peer)
        return record

    def _evict(self, now: float, keep: Hashable) -> None:
        """Forget one peer: a forgiven one first, then one not banned, then the ban that ends soonest."""

        def cost(item: tuple[Hashable, _Record]) -> tuple[int, float]:
            _, r = item
            if r.banned_until > now:
                return (2, r.banned_until)
            return (1 if self._decayed(r, now) > 0 or r.bans else 0, 0.0)

        candidates = [(p, r) for p, r in self._peers.items() if p != keep]
        victim = min(candidates, key=cost)[0]  # min() keeps the first (oldest) of equal costs
        del self._peers[victim]
