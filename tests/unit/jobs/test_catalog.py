"""Reading a job's commit from public records: the proof the planner accepts, forgeries dropped."""

from __future__ import annotations

import asyncio

from peerd.jobs.catalog import decode_votes, encode_votes, read_commit
from peerd.jobs.store import MemoryDHT
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.machine import ConsensusConfig, ConsensusMachine
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    Roster,
    RosterDevice,
    RosterEntry,
    Vote,
    encode,
)
from peerd.swarm.keys import commit_key, votes_key

JOB = "ab" * 16
T0 = 1_000_000.0
PEERS = [f"Qm{c * 20}" for c in "abcde"]
FAR = T0 + 1e6


class Records:
    """One planned epoch written to a MemoryDHT the way planners write it."""

    def __init__(self) -> None:
        self.dht = MemoryDHT(lambda: T0 + 100)
        device = RosterDevice(0.1, 8 << 30, "eu")
        self.roster = Roster.of(0, [RosterEntry(JOB, 0, p, T0, device, ()) for p in PEERS])
        alloc = Allocation(((PEERS[1], PEERS[2]), (PEERS[3], PEERS[4])), (PEERS[0],))
        self.candidate = self.make_candidate(0, alloc, 0.5)

    def make_candidate(self, epoch: int, alloc: Allocation, cost: float) -> Candidate:
        return Candidate(JOB, epoch, PEERS[1], T0 + 5, alloc, cost, self.roster.peers, self.roster.digest)

    def vote(self, voter: str, cand: Candidate, round_: int = 0) -> Vote:
        return Vote(JOB, cand.epoch, round_, voter, T0 + 8, cand.id, cand.cost, self.roster.digest)

    def put(self, key: str, author: str, value: bytes) -> None:
        assert asyncio.run(self.dht.client(author).put(key, value, FAR))

    def store_votes(self, votes: list[Vote], under: str | None = None) -> None:
        for v in votes:
            self.put(votes_key(JOB, v.epoch), under or v.voter, encode_votes([encode(v)]))

    def record(self, cand: Candidate, votes: list[Vote], author: str = PEERS[2]) -> CommitRecord:
        return CommitRecord(JOB, cand.epoch, 0, author, T0 + 9, cand, self.roster.refs, tuple(votes))

    def read(self):
        return asyncio.run(read_commit(self.dht.client(PEERS[0]), JOB))


def test_a_late_reader_gets_the_commit_the_planner_accepts() -> None:
    r = Records()
    votes = [r.vote(p, r.candidate) for p in PEERS[:3]]  # a quorum of 5
    r.store_votes(votes)
    record = r.record(r.candidate, votes)
    r.put(commit_key(JOB), record.author, encode(record))
    commit = r.read()
    assert commit is not None
    # the planner's machine, handed the same authenticated record, commits the same thing
    machine = ConsensusMachine(
        JOB, PEERS[0], ConsensusConfig(T0), lambda *_: 0.5, RosterDevice(0.1, 8 << 30, "eu")
    )
    machine.start(T0 + 100)
    machine.on_commit_record(record, T0 + 100)
    assert machine.committed is not None
    mine, theirs = commit, machine.committed
    assert (mine.epoch, mine.round, mine.allocation_hash, mine.candidate_id, mine.cost) == (
        theirs.epoch,
        theirs.round,
        theirs.allocation_hash,
        theirs.candidate_id,
        theirs.cost,
    )
    assert commit.allocation.spares == (PEERS[0],)


def test_records_without_a_signed_quorum_prove_nothing() -> None:
    r = Records()
    votes = [r.vote(p, r.candidate) for p in PEERS[:3]]
    # only two of the three embedded votes were stored by their voters: no quorum
    r.store_votes(votes[:2])
    r.put(commit_key(JOB), PEERS[2], encode(r.record(r.candidate, votes)))
    assert r.read() is None
    # the third vote stored under somebody else's subkey does not count either
    r.store_votes(votes[2:], under=PEERS[4])
    assert r.read() is None
    r.store_votes(votes[2:])
    assert r.read() is not None


def test_a_forged_newer_commit_is_ignored_for_the_proven_one() -> None:
    r = Records()
    votes = [r.vote(p, r.candidate) for p in PEERS[:3]]
    r.store_votes(votes)
    r.put(commit_key(JOB), PEERS[2], encode(r.record(r.candidate, votes)))
    # epoch 1: a candidate putting the forger in every slot, "voted" by votes nobody stored
    greedy = r.make_candidate(1, Allocation(((PEERS[4],),), tuple(PEERS[:4])), 0.1)
    fake = [r.vote(p, greedy) for p in PEERS[:3]]
    r.put(commit_key(JOB), PEERS[4], encode(r.record(greedy, fake, author=PEERS[4])))
    # a record naming an author other than the subkey it sits under
    r.put(commit_key(JOB), PEERS[3], encode(r.record(greedy, fake, author=PEERS[1])))
    commit = r.read()
    assert commit is not None and commit.epoch == 0
    assert commit.candidate_id == r.candidate.id.hex()


def test_an_equivocating_voter_does_not_count() -> None:
    r = Records()
    other = r.make_candidate(0, Allocation(((PEERS[0], PEERS[1]), (PEERS[2], PEERS[3])), (PEERS[4],)), 0.6)
    votes = [r.vote(p, r.candidate) for p in PEERS[:3]]
    r.store_votes(votes[1:])
    # voter a stored two different round-0 votes: counted for neither candidate
    both = [encode(votes[0]), encode(r.vote(PEERS[0], other))]
    r.put(votes_key(JOB, 0), PEERS[0], encode_votes(both))
    assert decode_votes(encode_votes(both)) == both
    r.put(commit_key(JOB), PEERS[2], encode(r.record(r.candidate, votes)))
    assert r.read() is None
