"""What the consensus state machine asks its driver to do: one small dataclass per action."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import CommitRecord, Message, Roster


@dataclass(frozen=True)
class Publish:
    """Store ``payload`` (encode with ``consensus.messages.encode``) in the DHT, signed by this peer."""

    kind: Literal["roster", "candidate", "vote", "commit"]
    payload: Message


@dataclass(frozen=True)
class StartSearch:
    """Start this peer's search island on ``roster`` with ``seed``; feed results to ``propose()``."""

    epoch: int
    roster: Roster
    seed: int


@dataclass(frozen=True)
class Migrate:
    """A verified foreign candidate: inject it into the running island as a migrant."""

    epoch: int
    allocation: Allocation
    cost: float
    author: str


@dataclass(frozen=True)
class StopSearch:
    """Stop the island of ``epoch``; nothing it proposes from now on is published."""

    epoch: int


@dataclass(frozen=True)
class Commit:
    """The allocation is decided. A later Commit (newer epoch) supersedes an earlier one."""

    epoch: int
    round: int
    allocation: Allocation
    allocation_hash: str  # hex of consensus.messages.allocation_hash
    candidate_id: str  # hex of the candidate id the quorum voted for
    cost: float
    record: CommitRecord  # the proof; also published


@dataclass(frozen=True)
class NextEpoch:
    """Epoch ``epoch - 1`` ended without a commit; this peer now plans ``epoch``."""

    epoch: int


@dataclass(frozen=True)
class Misbehaviour:
    """``peer`` equivocated or claimed a false cost: the driver may ban it for a while."""

    epoch: int
    peer: str
    what: str


Action = Publish | StartSearch | Migrate | StopSearch | Commit | NextEpoch | Misbehaviour
