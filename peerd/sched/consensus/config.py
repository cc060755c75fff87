"""Parameters every peer planning one job must share: phase lengths and protocol limits.

They travel in the job record, so all peers derive the same deadlines from
``epoch0_start`` (DHT time). Built by the planner from the job spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peerd.errors import ConfigError

if TYPE_CHECKING:
    from peerd.sched.consensus.messages import CommitRecord


@dataclass(frozen=True)
class ConsensusTiming:
    """Phase lengths of one planning epoch, in seconds of DHT time (see ``consensus``)."""

    roster_s: float = 10.0  # entries accepted this long after the epoch starts
    settle_s: float = 10.0  # late entries still propagate before the view freezes
    search_s: float = 30.0  # island search: the job's planning time budget
    exchange_s: float = 10.0  # final candidates propagate before anyone votes
    vote_s: float = 10.0  # round-0 votes
    adopt_s: float = 10.0  # round-1 votes; then the next epoch
    max_skew_s: float = 3.0  # DHT clocks agree within this (hivemind assumes ~3 s)
    publish_interval_s: float = 2.0  # at most one candidate per interval while searching

    def validate(self) -> None:
        # A window must outlast the skew between the earliest and the latest clock, or a
        # message sent at its start by a slow clock misses a fast clock's deadline.
        for name in ("settle_s", "exchange_s", "vote_s", "adopt_s"):
            if getattr(self, name) <= 2 * self.max_skew_s:
                raise ConfigError(f"timing.{name}", f"must exceed 2 × max_skew_s = {2 * self.max_skew_s} s")
        for name in ("roster_s", "search_s", "publish_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"timing.{name}", "must be > 0")
        if self.max_skew_s < 0:
            raise ConfigError("timing.max_skew_s", "must be >= 0")

    @property
    def freeze(self) -> float:
        """Offset from the epoch start at which the roster view freezes and search starts."""
        return self.roster_s + self.settle_s

    @property
    def stop(self) -> float:
        return self.freeze + self.search_s

    @property
    def decide(self) -> float:
        return self.stop + self.exchange_s

    @property
    def adopt(self) -> float:
        return self.decide + self.vote_s

    @property
    def period(self) -> float:
        return self.adopt + self.adopt_s


@dataclass(frozen=True)
class ConsensusConfig:
    """Per-job protocol parameters (identical on every peer of the job)."""

    epoch0_start: float  # DHT time at which epoch 0's roster opens
    timing: ConsensusTiming = field(default_factory=ConsensusTiming)
    min_peers: int = 1  # a smaller roster view does not plan: it waits for the next epoch
    faulty: int = 0  # equivocating voters tolerated; quorum = (n + faulty) // 2 + 1
    max_candidates_per_author: int = 16  # more from one author in one epoch are dropped
    cost_rtol: float = 1e-6  # claimed vs re-scored cost (same code and data: equal up to rounding)
    replan_margin: float = 0.05  # a re-plan moves surviving tasklets only for a cost gain above this
    anchor_epochs: int = (
        6  # re-plan epochs this close to the running commit also need a majority of its roster
    )

    def __post_init__(self) -> None:
        self.timing.validate()
        if self.min_peers < 1:
            raise ConfigError("min_peers", f"must be >= 1, got {self.min_peers}")
        if self.faulty < 0:
            raise ConfigError("faulty", f"must be >= 0, got {self.faulty}")
        if self.max_candidates_per_author < 2:
            raise ConfigError("max_candidates_per_author", "must be >= 2 (one slot is kept for the final)")
        if not 0 <= self.cost_rtol < 1:
            raise ConfigError("cost_rtol", "must be in [0, 1)")
        if not 0 <= self.replan_margin < 1:
            raise ConfigError("replan_margin", "must be in [0, 1)")
        if self.anchor_epochs < 0:
            raise ConfigError("anchor_epochs", "must be >= 0")

    def start(self, epoch: int) -> float:
        """DHT time at which ``epoch`` starts."""
        return self.epoch0_start + epoch * self.timing.period

    def anchor(self, committed: CommitRecord | None, epoch: int) -> frozenset[str]:
        """Peers a commit of re-plan ``epoch`` needs a majority of: the running commit's roster
        (``committed``: its CommitRecord), for ``anchor_epochs`` epochs after it; empty after that."""
        if committed is None or not committed.epoch < epoch <= committed.epoch + self.anchor_epochs:
            return frozenset()
        return frozenset(peer for peer, _ in committed.roster)

    def epoch_at(self, now: float) -> int:
        """The epoch running at ``now`` (0 before epoch 0)."""
        return max(0, int((now - self.epoch0_start) // self.timing.period))

    def replan_epoch(self, now: float, after: int) -> int:
        """The epoch a re-plan decided at ``now`` joins: the first after ``after`` whose roster is
        still open on this clock (every peer takes an entry issued up to ``roster_s + max_skew_s``
        into the epoch by its author's clock, and it arrives before their ``settle_s`` ends)."""
        epoch = max(after + 1, self.epoch_at(now))
        if now - self.start(epoch) > self.timing.roster_s:
            epoch += 1
        return epoch
