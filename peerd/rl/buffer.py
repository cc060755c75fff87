"""The rollout buffer between generation and training: groups within the staleness bound, older ones dropped.

A group made by policy version ``v`` is usable while the trainer is at version ``c`` with
``c - v <= staleness`` (``staleness = 0`` is sync mode: only rollouts of the current weights).
Groups are checked when they arrive and again when taken, since the trainer's version moves
on while they wait; every group dropped either way is counted, and every group handed out
adds its staleness to a histogram (what ``peerd status`` shows for an RL job).
A group "from the future" (``v > c``) is a bug or a forged record, and is refused loudly.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from peerd.errors import ConfigError, ProtocolError
from peerd.log import get_logger
from peerd.rl.rollout import RolloutGroup

log = get_logger(__name__)


@dataclass
class BufferStats:
    """What went through the buffer."""

    accepted: int = 0
    dropped_on_arrival: int = 0
    dropped_waiting: int = 0
    """Accepted, but the trainer moved past the bound before they were taken."""
    taken: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    """Staleness (trainer version - rollout version) of each taken group -> count."""

    @property
    def dropped(self) -> int:
        return self.dropped_on_arrival + self.dropped_waiting


class RolloutBuffer:
    """FIFO of rollout groups, bounded in staleness."""

    def __init__(self, staleness: int) -> None:
        if staleness < 0:
            raise ConfigError("staleness", f"must be >= 0, got {staleness}")
        self.staleness = staleness
        self._groups: deque[RolloutGroup] = deque()
        self.stats = BufferStats()

    def __len__(self) -> int:
        return len(self._groups)

    def _fresh(self, group: RolloutGroup, version: int) -> bool:
        if group.version > version:
            raise ProtocolError(
                f"rollout of policy version {group.version} is ahead of the trainer's {version}"
            )
        return version - group.version <= self.staleness

    def add(self, groups: list[RolloutGroup], version: int) -> int:
        """Queue ``groups`` arriving while the trainer is at ``version``; returns how many were kept."""
        kept = 0
        for g in groups:
            if self._fresh(g, version):
                self._groups.append(g)
                kept += 1
            else:
                self.stats.dropped_on_arrival += 1
        self.stats.accepted += kept
        if kept < len(groups):
            log.debug("dropped %d stale rollout groups at version %d", len(groups) - kept, version)
        return kept

    def take(self, n: int, version: int) -> list[RolloutGroup]:
        """Up to ``n`` oldest groups still within the bound at ``version``; stale ones met on the way are dropped."""
        out: list[RolloutGroup] = []
        while self._groups and len(out) < n:
            g = self._groups.popleft()
            if not self._fresh(g, version):
                self.stats.dropped_waiting += 1
                continue
            out.append(g)
            self.stats.staleness[version - g.version] += 1
        self.stats.taken += len(out)
        return out
