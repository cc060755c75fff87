"""What one peer knows about one planning epoch: its roster view, checked candidates, ballots.

Pure bookkeeping with status strings; the machine (``consensus``) turns statuses into
actions. Every rejection reason is also a key of ``ConsensusMachine.stats``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec.structs import replace

from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Candidate, CommitRecord, Message, Roster, RosterEntry, Vote
from peerd.sched.consensus.tally import Ballot, anchored, quorum, winner


@dataclass
class EpochState:
    """One epoch as seen by one peer."""

    epoch: int
    start: float  # DHT time
    faulty: int = 0  # ConsensusConfig.faulty
    entries: dict[str, RosterEntry] = field(default_factory=dict)
    conflicted: set[str] = field(default_factory=set)  # authors of two different entries
    roster: Roster | None = None  # the frozen view
    members: frozenset[str] = frozenset()
    pending: list[Message] = field(default_factory=list)  # arrived before the view froze
    received: set[Candidate] = field(default_factory=set)  # candidate messages (duplicates)
    per_author: Counter[str] = field(default_factory=Counter)
    seen: dict[bytes, Candidate] = field(default_factory=dict)  # first copy of each id
    scores: dict[bytes, float | None] = field(default_factory=dict)  # re-scores; None: unusable
    valid: dict[bytes, float] = field(default_factory=dict)  # votable: timely, claim matched
    ballots: tuple[Ballot, Ballot] = field(default_factory=lambda: (Ballot(), Ballot()))
    voted: list[bool] = field(default_factory=lambda: [False, False])
    done: set[str] = field(default_factory=set)  # phases already entered
    anchor: frozenset[str] = frozenset()  # a re-plan epoch's commit also needs a majority of these
    participant: bool = False  # own entry published in time
    best: tuple[float, Allocation] | None = None  # own island's best
    published_cost: float = math.inf
    published_n: int = 0
    last_publish: float = -math.inf

    def add_entry(self, entry: RosterEntry, latest_issue: float) -> str:
        """Returns "new", or why ``entry`` is not taken; a second different entry bans its author."""
        if self.roster is not None:
            return "roster_after_freeze"
        if entry.issued_at > latest_issue:
            return "roster_late"
        if entry.peer in self.conflicted:
            return "equivocation"
        seen = self.entries.get(entry.peer)
        if seen == entry:
            return "duplicate"
        if seen is not None:
            del self.entries[entry.peer]
            self.conflicted.add(entry.peer)
            return "conflict"
        self.entries[entry.peer] = entry
        return "new"

    def freeze(self) -> Roster:
        self.roster = Roster.of(self.epoch, list(self.entries.values()))
        self.members = frozenset(self.roster.peers)
        return self.roster

    @property
    def quorum(self) -> int:
        return quorum(len(self.members), self.faulty)

    def add_candidate(
        self,
        cand: Candidate,
        score: Callable[[Roster, Allocation], float | None],
        *,
        rtol: float,
        max_per_author: int,
        vote_by: float,
    ) -> tuple[str, float | None]:
        """Check one candidate message: ("valid" | "known" | a rejection reason, re-scored cost).

        A false claim rejects the *message*, never the candidate id: otherwise a liar could
        publish a good allocation first with a false cost and block every honest copy of it.
        Every well-formed candidate from a roster author is kept in ``seen`` (a quorum may
        have chosen it) even when it is not votable here.
        """
        assert self.roster is not None
        if cand in self.received:
            return "duplicate", None
        if cand.author not in self.members:
            return "not_on_roster", None
        self.per_author[cand.author] += 1
        if self.per_author[cand.author] > max_per_author:
            return "too_many_candidates", None
        self.received.add(cand)
        cid = cand.id
        self.seen.setdefault(cid, cand)
        if cid not in self.scores:
            sub = self.roster.subset(cand.members)
            if sub is None or sub.digest != cand.roster_digest:
                self.scores[cid] = None
                return "unknown_roster", None
            self.scores[cid] = score(sub, cand.allocation)
        cost = self.scores[cid]
        if cost is None:
            return "unscorable", None
        if not math.isclose(cost, cand.cost, rel_tol=rtol, abs_tol=1e-12):
            return "false_cost", cost
        if cand.issued_at > vote_by:
            return "candidate_late", cost
        if cid in self.valid:
            return "known", cost
        self.valid[cid] = cost
        return "valid", cost

    def quorum_proof(self, job: str, me: str, now: float) -> CommitRecord | None:
        """A commit record if some round has a quorum of this view for a candidate we hold."""
        if self.roster is None:
            return None
        for rnd, ballot in enumerate(self.ballots):
            counted = ballot.counted(self.roster.digest, self.members)
            cid = winner(Counter(v.candidate for v in counted), self.quorum)
            if cid is None or cid not in self.seen:
                continue
            cand = self.seen[cid]
            rescored = self.scores.get(cid)
            if rescored is not None:  # the first copy may carry a false claim
                cand = replace(cand, cost=rescored)
            votes = tuple(v for v in counted if v.candidate == cid)
            if not anchored({v.voter for v in votes}, self.anchor):
                continue  # a quorum of this view, but not of the running roster: another view may have one too
            return CommitRecord(job, self.epoch, rnd, me, now, cand, self.roster.refs, votes)
        return None

    def vote_cost(self, cid: bytes) -> float:
        """This peer's cost for ``cid``, or the lowest cost its round-0 voters reported."""
        if cid in self.valid:
            return self.valid[cid]
        return min(v.cost for v in self.ballots[0].votes.values() if v.candidate == cid)

    def add_vote(self, vote: Vote) -> str:
        return self.ballots[vote.round].add(vote)
