"""Vote counting for planning consensus: quorums, equivocation, the adoption rule, commit proofs.

Safety rests on two facts. (1) Every counted vote names the voter's whole roster view by
digest, and a quorum counts only votes that name the *same* view, so two quorums of one
view intersect in an honest voter when ``quorum(n, f) = (n + f) // 2 + 1`` and at most
``f`` voters equivocate. (Quorums of two different views intersect as long as every
honest voter's entry is in both views: the roster settle window exists for that.)
(2) A round-1 vote may only go to the single candidate that *could* have reached a
round-0 quorum somewhere, so a round-0 commit can never be overturned in round 1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Candidate, CommitRecord, Vote, roster_digest


def quorum(n: int, faulty: int = 0) -> int:
    """Votes needed among ``n`` roster peers so that any two quorums share an honest voter."""
    return (n + faulty) // 2 + 1


@dataclass
class Ballot:
    """The votes of one (epoch, round) as this peer has seen them."""

    votes: dict[str, Vote] = field(default_factory=dict)
    equivocators: set[str] = field(default_factory=set)

    def add(self, vote: Vote) -> str:
        """Record ``vote``; returns "new", "duplicate", "equivocation" or "ignored"."""
        if vote.voter in self.equivocators:
            return "ignored"
        seen = self.votes.get(vote.voter)
        if seen is None:
            self.votes[vote.voter] = vote
            return "new"
        if seen == vote:
            return "duplicate"
        # Two different votes by one author: count neither, forever.
        del self.votes[vote.voter]
        self.equivocators.add(vote.voter)
        return "equivocation"

    def counted(self, digest: bytes, members: frozenset[str]) -> list[Vote]:
        """Votes that count within the view ``digest`` (whose peers are ``members``)."""
        return [v for v in self.votes.values() if v.roster_digest == digest and v.voter in members]

    def tally(self, digest: bytes, members: frozenset[str]) -> Counter[bytes]:
        return Counter(v.candidate for v in self.counted(digest, members))


def winner(tally: Counter[bytes], need: int) -> bytes | None:
    """The candidate with at least ``need`` votes (unique when ``need`` is a quorum)."""
    best = [cid for cid, n in tally.items() if n >= need]
    assert len(best) <= 1 or need <= 0, "two candidates reached one quorum"
    return best[0] if best else None


def adoption_choice(
    round0: Ballot, digest: bytes, members: frozenset[str], need: int, cost_of: dict[bytes, float]
) -> bytes | None:
    """What to vote in round 1 after round 0 failed to commit here, or None to abstain.

    ``unseen`` roster peers may have voted anything. A candidate is *possible* if its seen
    votes plus ``unseen`` reach the quorum: only a possible candidate can have committed
    elsewhere. One possible candidate: adopt it. None: adopt the plurality (most votes,
    then lowest cost, then lowest id). Several, or any unseen candidate possible: abstain.
    """
    counted = round0.counted(digest, members)
    tally = Counter(v.candidate for v in counted)
    unseen = len(members) - len(counted)
    if unseen >= need:
        return None
    possible = [cid for cid, n in tally.items() if n + unseen >= need]
    if len(possible) == 1:
        return possible[0]
    if possible or not tally:
        return None

    def cost(cid: bytes) -> float:
        if cid in cost_of:
            return cost_of[cid]
        return min(v.cost for v in counted if v.candidate == cid)

    return min(tally, key=lambda cid: (-tally[cid], cost(cid), cid))


def moved_tasklets(allocation: Allocation, previous: Allocation) -> int:
    """Tasklets of ``allocation`` whose peer did not run that stage in ``previous``: each needs the stage's state sent."""
    before = {p: k for k, stage in enumerate(previous.stages) for p in stage}
    return sum(before.get(p) != k for k, stage in enumerate(allocation.stages) for p in stage)


def replan_choice(
    valid: dict[bytes, float], allocations: dict[bytes, Allocation], previous: Allocation, margin: float
) -> bytes | None:
    """Round-0 choice of a re-plan epoch: hysteresis over the running allocation ``previous``.

    Only candidates that keep its pipeline depth and layer split count (the stages' state
    can follow them). Among those within ``margin`` of the cheapest, the one moving the
    fewest tasklets wins, then the cheaper, then the lower id: a repair that refills the
    holes beats a reshuffle unless the reshuffle gains more than the margin. None when no
    candidate keeps the shape (the job waits for peers instead of restarting from scratch).
    """
    keep = {
        c: cost
        for c, cost in valid.items()
        if allocations[c].d_pp == previous.d_pp and allocations[c].layers == previous.layers
    }
    if not keep:
        return None
    best = min(keep.values())
    near = [c for c, cost in keep.items() if cost <= best + abs(best) * margin]
    return min(near, key=lambda c: (moved_tasklets(allocations[c], previous), keep[c], c))


def anchored(voters: set[str] | frozenset[str], anchor: frozenset[str]) -> bool:
    """Whether ``voters`` hold a majority of ``anchor`` (always, when there is no anchor)."""
    return not anchor or len(voters & anchor) >= len(anchor) // 2 + 1


def verify_record(
    record: CommitRecord, faulty: int, equivocators: set[str], anchor: frozenset[str] = frozenset()
) -> str | None:
    """Why ``record`` does not prove a commit, or None if it does.

    The record must carry a quorum (of its own roster) of distinct votes for its candidate
    in its round, each naming the record's roster digest; ``equivocators`` (voters this
    peer caught voting twice in that epoch and round) do not count. In a re-plan epoch those
    voters must also hold a majority of ``anchor``, the running commit's roster: two views that
    do not overlap (a partition over the roster window) cannot both have one.
    """
    digest = roster_digest(record.roster)
    members = frozenset(p for p, _ in record.roster)
    cand: Candidate = record.candidate
    if (cand.job, cand.epoch) != (record.job, record.epoch):
        return "candidate of another job or epoch"
    voters: set[str] = set()
    for v in record.votes:
        if (v.job, v.epoch, v.round) != (record.job, record.epoch, record.round):
            return f"vote by {v.voter} for another job, epoch or round"
        if v.candidate != cand.id or v.roster_digest != digest:
            return f"vote by {v.voter} for another candidate or roster"
        if v.voter not in members:
            return f"voter {v.voter} not on the record's roster"
        if v.voter in voters:
            return f"two votes by {v.voter}"
        voters.add(v.voter)
    if len(voters - equivocators) < quorum(len(members), faulty):
        return f"{len(voters - equivocators)} valid votes, quorum is {quorum(len(members), faulty)}"
    if not anchored(voters - equivocators, anchor):
        return f"{len((voters - equivocators) & anchor)} voters of the running roster's {len(anchor)}: no majority"
    return None
