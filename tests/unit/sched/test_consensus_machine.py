"""Consensus state machine, scripted: each protocol rule exercised on a few peers with a controllable network."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from msgspec.structs import replace

from peerd.errors import ConfigError, InfeasibleError
from peerd.sched.allocation import Allocation
from peerd.sched.consensus import machine as consensus
from peerd.sched.consensus.actions import (
    Commit,
    Migrate,
    Misbehaviour,
    NextEpoch,
    Publish,
    StartSearch,
    StopSearch,
)
from peerd.sched.consensus.machine import ConsensusConfig, ConsensusMachine, ConsensusTiming
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    Roster,
    RosterDevice,
    RosterEntry,
    Vote,
    decode,
    encode,
    roster_digest,
)

JOB = "job-1"
T0 = 100.0
TIMING = ConsensusTiming()  # roster 10, settle 10, search 30, exchange 10, vote 10, adopt 10
FREEZE, STOP, DECIDE, ADOPT, END = (T0 + x for x in (20, 50, 60, 70, 80))
TFLOPS = {"p0": 100.0, "p1": 80.0, "p2": 60.0, "p3": 40.0, "p4": 20.0}


def score(roster: Roster, alloc: Allocation) -> float:
    """Earlier stages weigh more, so fast devices belong early. Uses the roster's profiles."""
    tf = {e.peer: e.profile.tflops for e in roster.entries}
    if any(d not in tf for d in alloc.devices):
        raise InfeasibleError("device off roster")
    n = len(alloc.stages)
    return sum((n - i) * 100.0 / tf[d] for i, stage in enumerate(alloc.stages) for d in stage)


def alloc(*stages: tuple[str, ...], spares: tuple[str, ...] = ()) -> Allocation:
    return Allocation.from_plain(stages, spares)


# Three allocations of p0..p3 (2 stages x 2 replicas), cheapest first.
BEST = alloc(("p0", "p1"), ("p2", "p3"))
MID = alloc(("p0", "p2"), ("p1", "p3"))
WORST = alloc(("p2", "p3"), ("p0", "p1"))


class Net:
    """Peers on a shared clock; Publish actions go to every other peer unless ``block`` says no."""

    def __init__(self, peers: list[str], *, config: ConsensusConfig | None = None, score_fn=score) -> None:
        self.config = config or ConsensusConfig(epoch0_start=T0, timing=TIMING)
        self.m = {
            p: ConsensusMachine(JOB, p, self.config, score_fn, RosterDevice(TFLOPS[p], 16 << 30))
            for p in peers
        }
        self.proposals: dict[str, Allocation] = {}  # what each island "finds"
        self.log: dict[str, list] = {p: [] for p in peers}
        self.block: Callable[[str, str, object], bool] = lambda src, dst, msg: False
        self.held: list[tuple[str, str, object]] = []
        self.now = 0.0

    def run_actions(self, peer: str, actions: list) -> None:
        for a in actions:
            self.log[peer].append(a)
            if isinstance(a, Publish):
                wire = encode(a.payload)  # everything crosses the real codec
                for dst in self.m:
                    if dst != peer:
                        self.held.append((peer, dst, wire))
            elif isinstance(a, StartSearch) and peer in self.proposals:
                self.run_actions(peer, self.m[peer].propose(self.proposals[peer], self.now))
        self.flush()

    def flush(self) -> None:
        while True:
            ready = [h for h in self.held if not self.block(h[0], h[1], decode(h[2]))]
            if not ready:
                return
            self.held = [h for h in self.held if h not in ready]
            for _, dst, wire in ready:
                self.run_actions(dst, self.m[dst].on_message(decode(wire), self.now))

    def deliver(self, dst: str, msg: object) -> list:
        actions = self.m[dst].on_message(decode(encode(msg)), self.now)
        self.run_actions(dst, actions)
        return actions

    def start(self, now: float = T0) -> None:
        self.now = now
        for p, m in self.m.items():
            self.run_actions(p, m.start(now))

    def tick(self, now: float, peers: list[str] | None = None) -> None:
        self.now = now
        for p in peers or list(self.m):
            self.run_actions(p, self.m[p].on_tick(now))

    def of(self, peer: str, kind: type) -> list:
        return [a for a in self.log[peer] if isinstance(a, kind)]

    def commits(self) -> dict[str, Commit | None]:
        return {p: m.committed for p, m in self.m.items()}


def four(**kw) -> Net:
    net = Net(["p0", "p1", "p2", "p3"], **kw)
    net.proposals = {"p0": MID, "p1": BEST, "p2": WORST, "p3": MID}
    return net


def run_epoch(net: Net, epoch: int = 0) -> None:
    base = epoch * TIMING.period
    for t in (FREEZE, STOP, DECIDE, ADOPT, END):
        net.tick(t + base)


def roster_of(net: Net, peer: str = "p0", epoch: int = 0) -> Roster:
    return net.m[peer]._epochs[epoch].roster


# --- the normal path --------------------------------------------------------------------------


def test_all_peers_commit_the_cheapest_candidate_in_round_0() -> None:
    net = four()
    net.start()
    assert all(len(net.of(p, Publish)) == 1 for p in net.m)  # own roster entry
    net.tick(FREEZE)
    assert all(len(net.of(p, StartSearch)) == 1 for p in net.m)
    roster = net.of("p0", StartSearch)[0].roster
    assert roster.peers == ("p0", "p1", "p2", "p3") and all(
        net.of(p, StartSearch)[0].roster == roster for p in net.m
    )
    migrants = {(a.author, a.allocation.digest()) for a in net.of("p0", Migrate)}
    assert ("p1", BEST.digest()) in migrants and all(author != "p0" for author, _ in migrants)
    net.tick(STOP)
    assert all(net.of(p, StopSearch) for p in net.m)
    net.tick(DECIDE)
    commits = net.commits()
    assert all(c is not None for c in commits.values())
    assert {c.allocation_hash for c in commits.values()} == {BEST.digest()}
    assert {(c.epoch, c.round) for c in commits.values()} == {(0, 0)}
    assert commits["p2"].cost == pytest.approx(score(roster, BEST))
    # Every peer published a commit record that proves it to anyone.
    records = [a.payload for p in net.m for a in net.of(p, Publish) if a.kind == "commit"]
    assert len(records) == 4 and all(len(r.votes) >= 3 for r in records)
    # Nothing more happens once committed: no next epoch.
    net.tick(END + 100)
    assert not any(net.of(p, NextEpoch) for p in net.m)


def test_island_seeds_differ_per_peer_and_replay() -> None:
    net = four()
    net.start()
    net.tick(FREEZE)
    seeds = {p: net.of(p, StartSearch)[0].seed for p in net.m}
    assert len(set(seeds.values())) == 4
    again = four()
    again.start()
    again.tick(FREEZE)
    assert seeds == {p: again.of(p, StartSearch)[0].seed for p in again.m}


def test_candidates_are_rate_limited_and_the_final_best_is_published_at_stop() -> None:
    net = four()
    net.proposals = {}
    net.start()
    net.tick(FREEZE)
    m = net.m["p0"]
    published = lambda: [a for a in net.of("p0", Publish) if a.kind == "candidate"]  # noqa: E731
    net.run_actions("p0", m.propose(WORST, FREEZE + 1))
    net.run_actions("p0", m.propose(MID, FREEZE + 1.5))  # within publish_interval_s: held back
    assert [a.payload.allocation.digest() for a in published()] == [WORST.digest()]
    net.run_actions("p0", m.propose(BEST, FREEZE + 1.6))
    net.tick(STOP)
    assert [a.payload.allocation.digest() for a in published()] == [WORST.digest(), BEST.digest()]
    net.run_actions("p0", m.propose(MID, STOP + 1))  # after stop: ignored
    assert len(published()) == 2


# --- rejections -------------------------------------------------------------------------------


def test_false_cost_claim_is_rejected_flagged_and_cannot_block_the_honest_copy() -> None:
    net = four()
    net.proposals = {}
    net.start()
    net.tick(FREEZE)
    roster = roster_of(net)
    true = score(roster, BEST)
    lie = Candidate(JOB, 0, "p3", FREEZE + 1, BEST, true / 2, roster.peers, roster.digest)
    acts = net.deliver("p0", lie)
    assert [a.peer for a in acts if isinstance(a, Misbehaviour)] == ["p3"]
    es = net.m["p0"]._epochs[0]
    assert lie.id not in es.valid
    honest = replace(lie, author="p1", cost=true)
    acts = net.deliver("p0", honest)
    assert es.valid[honest.id] == pytest.approx(true)
    assert any(isinstance(a, Migrate) and a.author == "p1" for a in acts)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"job": "other-job"}, "other_job"),
        ({"epoch": 5}, "other_epoch"),
        ({"author": "stranger"}, "not_on_roster"),
        ({"members": ("p0", "p1", "p2", "p3", "p9")}, "unknown_roster"),
        ({"roster_digest": bytes(32)}, "unknown_roster"),
    ],
)
def test_candidates_from_elsewhere_are_rejected(change: dict, reason: str) -> None:
    net = four()
    net.proposals = {}
    net.start()
    net.tick(FREEZE)
    roster = roster_of(net)
    cand = Candidate(JOB, 0, "p1", FREEZE + 1, BEST, score(roster, BEST), roster.peers, roster.digest)
    net.deliver("p0", replace(cand, **change))
    assert net.m["p0"].stats[reason] == 1
    assert not net.m["p0"]._epochs[0].valid


def test_candidate_on_a_sub_roster_is_scored_on_that_sub_roster() -> None:
    net = Net(["p0", "p1", "p2", "p3", "p4"])
    net.start()
    net.tick(FREEZE)
    sub = roster_of(net).subset(["p0", "p1", "p2", "p3"])
    cand = Candidate(JOB, 0, "p4", FREEZE + 1, BEST, score(sub, BEST), sub.peers, sub.digest)
    net.deliver("p0", cand)
    assert net.m["p0"]._epochs[0].valid == {cand.id: pytest.approx(score(sub, BEST))}


def test_duplicates_late_candidates_unscorable_and_per_author_limit() -> None:
    cfg = ConsensusConfig(epoch0_start=T0, timing=TIMING, max_candidates_per_author=3)
    net = four(config=cfg)
    net.proposals = {}
    net.start()
    net.tick(FREEZE)
    roster = roster_of(net)
    m = net.m["p0"]
    cand = Candidate(JOB, 0, "p1", FREEZE + 1, BEST, score(roster, BEST), roster.peers, roster.digest)
    net.deliver("p0", cand)
    net.deliver("p0", cand)
    assert m.stats["duplicate"] == 1
    late = replace(cand, allocation=MID, cost=score(roster, MID), issued_at=DECIDE + 10)
    net.deliver("p0", late)
    assert m.stats["candidate_late"] == 1 and late.id not in m._epochs[0].valid
    off = alloc(("p0", "p1"), ("p2", "p3"))
    net.deliver("p0", replace(cand, allocation=off, issued_at=FREEZE + 2))  # same id, other message
    net.deliver("p0", replace(cand, allocation=WORST, cost=1.0, issued_at=FREEZE + 3))
    assert m.stats["too_many_candidates"] == 1


def test_unscorable_allocation_is_rejected() -> None:
    def picky(roster: Roster, a: Allocation) -> float:
        if a.stages[0][0] == "p2":
            raise InfeasibleError("p2 cannot hold stage 0")
        return score(roster, a)

    net = four(score_fn=picky)
    net.proposals = {}
    net.start()
    net.tick(FREEZE)
    roster = roster_of(net)
    net.deliver("p0", Candidate(JOB, 0, "p1", FREEZE + 1, WORST, 1.0, roster.peers, roster.digest))
    assert net.m["p0"].stats["unscorable"] == 1


def test_conflicting_roster_entries_exclude_their_author() -> None:
    net = four()
    net.block = lambda src, dst, msg: src == "p3" and isinstance(msg, RosterEntry)
    net.start()
    entry = net.of("p3", Publish)[0].payload
    net.deliver("p0", entry)
    acts = net.deliver("p0", replace(entry, profile=RosterDevice(999.0, 1)))
    assert [a.peer for a in acts if isinstance(a, Misbehaviour)] == ["p3"]
    net.deliver("p0", entry)
    assert net.m["p0"].stats["equivocation"] == 1
    net.tick(FREEZE, ["p0"])
    assert roster_of(net).peers == ("p0", "p1", "p2")


def test_roster_entries_issued_after_close_or_arriving_after_freeze_are_refused() -> None:
    net = four()
    net.block = lambda src, dst, msg: src == "p3"
    net.start()
    entry = net.of("p3", Publish)[0].payload
    net.deliver("p0", replace(entry, issued_at=T0 + TIMING.roster_s + TIMING.max_skew_s + 0.1))
    assert net.m["p0"].stats["roster_late"] == 1
    net.tick(FREEZE, ["p0"])
    net.deliver("p0", entry)
    assert net.m["p0"].stats["roster_after_freeze"] == 1
    assert roster_of(net).peers == ("p0", "p1", "p2")


def test_messages_before_start_and_before_freeze_are_kept_for_later() -> None:
    net = four()
    for p in ("p1", "p2", "p3"):
        net.run_actions(p, net.m[p].start(T0))
    early = [decode(w) for src, dst, w in net.held if dst == "p0"]
    net.held = [h for h in net.held if h[1] != "p0"]
    for msg in early:  # before p0 started: no epoch known yet
        assert net.m["p0"].on_message(msg, T0) == []
    net.run_actions("p0", net.m["p0"].start(T0 + 1))
    net.tick(FREEZE - 5, ["p1", "p2", "p3"])
    net.tick(FREEZE + 0.5, ["p1"])  # p1's clock runs ahead: it freezes and proposes first
    assert net.m["p0"]._epochs[0].pending
    net.tick(FREEZE, ["p0"])
    assert roster_of(net).peers == ("p0", "p1", "p2", "p3")
    assert not net.m["p0"]._epochs[0].pending and net.m["p0"]._epochs[0].valid


# --- votes, quorums, rounds, epochs -----------------------------------------------------------


def _vote(net: Net, voter: str, cand: bytes, rnd: int = 0, at: float = DECIDE) -> Vote:
    return Vote(JOB, 0, rnd, voter, at, cand, 1.0, roster_of(net).digest)


def test_equivocating_voter_counts_for_neither_side() -> None:
    net = four()
    net.block = lambda src, dst, msg: isinstance(msg, Vote)
    net.start()
    for t in (FREEZE, STOP, DECIDE):
        net.tick(t)
    best = next(a.payload.candidate for a in net.of("p0", Publish) if a.kind == "vote")
    other = next(c for c in net.m["p0"]._epochs[0].valid if c != best)
    acts = net.deliver("p0", _vote(net, "p3", best))
    acts += net.deliver("p0", _vote(net, "p3", other))  # p3 votes twice, differently
    assert [a.peer for a in acts if isinstance(a, Misbehaviour)] == ["p3"]
    net.deliver("p0", _vote(net, "p1", best))
    assert net.m["p0"].committed is None  # p0 + p1 = 2 < quorum 3; p3 counts for neither
    net.deliver("p0", _vote(net, "p3", best))
    assert net.m["p0"].committed is None
    net.deliver("p0", _vote(net, "p2", best))
    assert net.m["p0"].committed is not None


def test_votes_from_another_view_or_off_roster_do_not_count() -> None:
    net = four()
    net.block = lambda src, dst, msg: isinstance(msg, Vote)
    net.start()
    for t in (FREEZE, STOP, DECIDE):
        net.tick(t)
    best = next(a.payload.candidate for a in net.of("p0", Publish) if a.kind == "vote")
    net.deliver("p0", replace(_vote(net, "p1", best), roster_digest=bytes(32)))
    net.deliver("p0", _vote(net, "p2", best))
    net.deliver("p0", _vote(net, "intruder", best))
    assert net.m["p0"].stats["not_on_roster"] == 1
    assert net.m["p0"].committed is None


def test_split_votes_are_resolved_by_adopting_the_plurality_in_round_1() -> None:
    net = Net(["p0", "p1", "p2", "p3", "p4"])
    c1 = alloc(("p0", "p1"), ("p2", "p3"), spares=("p4",))
    c2 = alloc(("p0", "p2"), ("p1", "p3"), spares=("p4",))
    c3 = alloc(("p2", "p3"), ("p0", "p1"), spares=("p4",))
    net.proposals = {"p0": c1, "p2": c2, "p4": c3}
    groups = {"p0": {"p0", "p1"}, "p2": {"p2", "p3"}, "p4": {"p4"}}

    voting = {"done": False}

    def hold(src: str, dst: str, msg: object) -> bool:  # until all voted, candidates stay in their group
        return isinstance(msg, Candidate) and not voting["done"] and dst not in groups[src]

    net.block = hold
    net.start()
    for t in (FREEZE, STOP, DECIDE):
        net.tick(t)
    voting["done"] = True
    net.flush()
    r0 = {p: next(a.payload.candidate for a in net.of(p, Publish) if a.kind == "vote") for p in net.m}
    ids = {
        p: Candidate(JOB, 0, p, 0, a, 0, ("p0", "p1", "p2", "p3", "p4"), roster_of(net).digest).id
        for p, a in net.proposals.items()
    }
    assert r0 == {"p0": ids["p0"], "p1": ids["p0"], "p2": ids["p2"], "p3": ids["p2"], "p4": ids["p4"]}
    assert all(c is None for c in net.commits().values())  # 2 / 2 / 1: no quorum of 3
    net.tick(ADOPT)
    commits = net.commits()
    assert {(c.round, c.allocation_hash) for c in commits.values()} == {
        (1, c1.digest())
    }  # tie 2-2: cheaper c1


def test_round_1_never_votes_against_a_round_0_commit_it_cannot_rule_out() -> None:
    """p0 commits X in round 0; p3 saw only one X vote and two Y votes. Y has the plurality in
    p3's view, but X may have committed (two votes unseen), so p3 must abstain, not vote Y."""
    net = Net(["p0", "p1", "p2", "p3", "p4"])
    x = alloc(("p0", "p1"), ("p2", "p3"), spares=("p4",))
    y = alloc(("p0", "p2"), ("p1", "p3"), spares=("p4",))
    net.proposals = {"p0": x, "p3": y}
    left, right = {"p0", "p1", "p2"}, {"p3", "p4"}
    voting = {"done": False}

    def block(src: str, dst: str, msg: object) -> bool:
        if isinstance(msg, Candidate) and not voting["done"]:
            return (src in left) != (dst in left)  # X stays left, Y stays right until all voted
        if isinstance(msg, Vote) and dst in right and src in ("p1", "p2"):
            return True  # two of X's votes never reach the right side
        return isinstance(msg, CommitRecord) and dst in right

    net.block = block
    net.start()
    net.tick(FREEZE)
    net.tick(STOP)
    net.tick(DECIDE, ["p0", "p1", "p2"])
    net.tick(DECIDE, ["p3", "p4"])
    voting["done"] = True
    net.flush()
    assert net.m["p0"].committed is not None and net.m["p0"].committed.allocation_hash == x.digest()
    assert net.m["p3"].committed is None
    net.tick(ADOPT, ["p3", "p4"])
    round1 = [
        a.payload
        for p in ("p3", "p4")
        for a in net.of(p, Publish)
        if a.kind == "vote" and a.payload.round == 1
    ]
    assert round1 == [] and net.m["p3"].stats["abstain"] == 1


def test_missed_quorum_moves_everyone_to_the_next_epoch_which_then_commits() -> None:
    net = four()
    net.block = lambda src, dst, msg: isinstance(msg, Vote) and msg.epoch == 0
    net.start()
    run_epoch(net, 0)
    assert all(c is None for c in net.commits().values())
    assert all([a.epoch for a in net.of(p, NextEpoch)] == [1] for p in net.m)
    entries = [
        a.payload for p in net.m for a in net.of(p, Publish) if a.kind == "roster" and a.payload.epoch == 1
    ]
    assert len(entries) == 4
    net.held = [h for h in net.held if decode(h[2]).epoch != 0]  # epoch 0's votes are lost for good
    net.block = lambda src, dst, msg: False
    run_epoch(net, 1)
    assert {(c.epoch, c.allocation_hash) for c in net.commits().values()} == {(1, BEST.digest())}


def test_late_votes_of_the_previous_epoch_still_complete_its_quorum() -> None:
    net = four()
    net.block = lambda src, dst, msg: isinstance(msg, Vote) and msg.epoch == 0
    net.start()
    run_epoch(net, 0)
    assert all(m.epoch == 1 and m.committed is None for m in net.m.values())
    net.block = lambda src, dst, msg: False
    net.flush()  # the delayed votes arrive during epoch 1
    assert {(c.epoch, c.allocation_hash) for c in net.commits().values()} == {(0, BEST.digest())}


def test_a_late_commit_record_is_adopted_by_a_peer_already_in_the_next_epoch() -> None:
    net = four()
    net.block = lambda src, dst, msg: dst == "p3" and isinstance(msg, Vote | CommitRecord)
    net.start()
    run_epoch(net, 0)
    assert net.m["p3"].committed is None and net.m["p3"].epoch == 1
    net.tick(T0 + TIMING.period + FREEZE - T0, ["p3"])  # p3 searches in epoch 1
    record = next(a.payload for a in net.of("p0", Publish) if a.kind == "commit")
    acts = net.deliver("p3", record)
    assert any(isinstance(a, StopSearch) and a.epoch == 1 for a in acts)
    c = net.m["p3"].committed
    assert (c.epoch, c.allocation_hash) == (0, BEST.digest())


def _forged_record(epoch: int, voters: list[str], *, n: int = 4, alloc_: Allocation = MID) -> CommitRecord:
    refs = tuple((f"p{i}", bytes([i]) * 32) for i in range(n))
    digest = roster_digest(refs)
    cand = Candidate(JOB, epoch, "p0", 1.0, alloc_, 5.0, tuple(p for p, _ in refs), digest)
    votes = tuple(Vote(JOB, epoch, 0, v, 2.0, cand.id, 5.0, digest) for v in voters)
    return CommitRecord(JOB, epoch, 0, "p0", 3.0, cand, refs, votes)


def test_a_commit_record_of_a_newer_epoch_supersedes() -> None:
    net = four()
    net.start()
    run_epoch(net, 0)
    assert net.m["p1"].committed.epoch == 0
    acts = net.deliver("p1", _forged_record(1, ["p0", "p1", "p2"]))
    c = [a for a in acts if isinstance(a, Commit)]
    assert len(c) == 1 and (c[0].epoch, c[0].allocation_hash) == (1, MID.digest())
    net.deliver("p1", _forged_record(0, ["p0", "p1", "p2"], alloc_=WORST))  # older: ignored
    assert net.m["p1"].committed.epoch == 1


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: replace(r, votes=r.votes[:2]),  # 2 < quorum 3
        lambda r: replace(r, votes=(*r.votes[:2], replace(r.votes[2], candidate=bytes(32)))),
        lambda r: replace(r, votes=(*r.votes[:2], replace(r.votes[2], voter="p9"))),
        lambda r: replace(r, votes=(*r.votes[:2], r.votes[1])),  # same voter twice
        lambda r: replace(r, roster=r.roster[:3]),  # digest no longer matches the votes
        lambda r: replace(r, votes=tuple(replace(v, round=1) for v in r.votes)),
        lambda r: replace(r, candidate=replace(r.candidate, epoch=3)),
    ],
)
def test_commit_records_without_a_valid_quorum_are_rejected(mutate) -> None:
    net = four()
    net.start()
    net.tick(FREEZE)
    net.deliver("p0", mutate(_forged_record(0, ["p0", "p1", "p2"])))
    assert net.m["p0"].committed is None and net.m["p0"].stats["bad_commit_record"] == 1


def test_a_record_exposing_an_equivocator_does_not_prove_a_commit() -> None:
    net = four()
    net.start()
    net.tick(FREEZE)
    record = _forged_record(0, ["p1", "p2", "p3"])
    seen = replace(record.votes[2], candidate=bytes(32))
    net.m["p0"]._epochs[0].add_vote(seen)  # p0 already holds a different round-0 vote of p3
    acts = net.deliver("p0", record)
    assert any(isinstance(a, Misbehaviour) and a.peer == "p3" for a in acts)
    assert net.m["p0"].committed is None


def test_a_peer_joining_after_the_roster_closed_observes_and_follows_the_commit() -> None:
    net = Net(["p0", "p1", "p2", "p3", "p4"])
    net.proposals = {"p0": BEST, "p1": BEST}
    for p in ("p0", "p1", "p2", "p3"):
        net.run_actions(p, net.m[p].start(T0))
    acts = net.m["p4"].start(T0 + TIMING.roster_s + 1)
    assert not [a for a in acts if isinstance(a, Publish)]  # too late for a roster entry
    net.run_actions("p4", acts)
    run_epoch(net, 0)
    assert net.m["p4"].committed is not None
    assert net.m["p4"].committed.allocation_hash == net.m["p0"].committed.allocation_hash


def test_a_roster_below_min_peers_does_not_plan() -> None:
    net = four(config=ConsensusConfig(epoch0_start=T0, timing=TIMING, min_peers=5))
    net.start()
    run_epoch(net, 0)
    assert not any(net.of(p, StartSearch) for p in net.m)
    assert not any(a.kind == "vote" for p in net.m for a in net.of(p, Publish))
    assert all(net.of(p, NextEpoch) for p in net.m)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"settle_s": 6.0}, "timing.settle_s"),
        ({"vote_s": 5.0}, "timing.vote_s"),
        ({"search_s": 0.0}, "timing.search_s"),
        ({"max_skew_s": -1.0, "settle_s": 10.0}, "timing.max_skew_s"),
    ],
)
def test_timing_must_outlast_the_clock_skew(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ConsensusConfig(epoch0_start=0.0, timing=ConsensusTiming(**kw))
    assert err.value.field == field


def test_config_limits() -> None:
    with pytest.raises(ConfigError, match="min_peers"):
        ConsensusConfig(epoch0_start=0.0, min_peers=0)
    with pytest.raises(ConfigError, match="max_candidates_per_author"):
        ConsensusConfig(epoch0_start=0.0, max_candidates_per_author=1)


def test_held_messages_are_bounded() -> None:
    m = four().m["p0"]
    vote = Vote(JOB, 0, 0, "p1", 1.0, bytes(32), 1.0, bytes(32))
    for i in range(consensus.MAX_HELD + 5):
        m.on_vote(replace(vote, issued_at=float(i)), T0)  # before start(): held
    assert len(m._early) == consensus.MAX_HELD and m.stats["held_full"] == 5


# --- re-planning a running job ---------------------------------------------------------------


def _held(stage: int, *steps: int) -> tuple:
    from peerd.sched.consensus.messages import HeldState

    return (HeldState(stage, (stage, stage + 1), steps),)


def test_replan_is_a_no_op_before_a_commit_and_while_re_planning() -> None:
    net = four()
    net.start()
    assert net.m["p0"].replan(T0 + 5) == []
    run_epoch(net, 0)
    first = net.m["p0"].replan(END + 1)
    assert [a.kind for a in first if isinstance(a, Publish)] == ["roster"]
    assert net.m["p0"].replan(END + 2) == []
    assert net.m["p0"].stats["replan"] == 1


def test_replan_joins_the_next_open_epoch_with_the_state_it_holds() -> None:
    net = four()
    net.start()
    run_epoch(net, 0)  # committed in epoch 0 at DECIDE
    m = net.m["p0"]
    m.set_held(_held(0, 6, 7))
    # Epoch 1 starts at END; its roster is open for 10 s: a re-plan 3 s in joins it,
    # one 11 s in (past the window) joins epoch 2.
    acts = m.replan(END + 3)
    entry = next(a.payload for a in acts if isinstance(a, Publish))
    assert (entry.epoch, entry.held) == (1, _held(0, 6, 7)) and m.epoch == 1
    late = four()
    late.start()
    run_epoch(late, 0)
    late.m["p1"].replan(END + 11)
    assert late.m["p1"].epoch == 2


def test_a_replan_commits_the_repair_of_the_dead_peer_and_announces_it() -> None:
    """p3 dies; p4 (a newcomer) is on the re-plan roster and fills p3's slot; the commit is a new epoch's."""
    net = Net(["p0", "p1", "p2", "p3"])
    net.proposals = {p: BEST for p in net.m}
    net.start()
    run_epoch(net, 0)
    assert {c.allocation_hash for c in net.commits().values()} == {BEST.digest()}
    del net.m["p3"]
    net.held = []
    net.m["p4"] = ConsensusMachine(JOB, "p4", net.config, score, RosterDevice(TFLOPS["p4"], 16 << 30))
    net.log["p4"] = []
    repaired = alloc(("p0", "p1"), ("p2", "p4"))
    reshuffle = alloc(("p0", "p2"), ("p1", "p4"))  # dearer, and moves two survivors
    net.proposals = {"p0": repaired, "p1": reshuffle, "p2": repaired, "p4": reshuffle}
    net.now = END + 1
    for p in ("p0", "p1", "p2"):
        net.run_actions(p, net.m[p].replan(END + 1))
    net.run_actions("p4", net.m["p4"].start(END + 1))  # a newcomer joins the epoch running now
    for t in (FREEZE, STOP, DECIDE, ADOPT):
        net.tick(t + TIMING.period)
    commits = net.commits()
    assert {c.epoch for c in commits.values()} == {1}
    assert {c.allocation_hash for c in commits.values()} == {repaired.digest()}
    announced = [a for a in net.of("p0", Commit)]
    assert [c.epoch for c in announced] == [0, 1]
    assert all(m.replanning is None for m in net.m.values())


def test_a_replan_does_not_vote_for_a_shape_the_state_cannot_follow() -> None:
    net = Net(["p0", "p1", "p2", "p3"])
    net.proposals = {p: BEST for p in net.m}
    net.start()
    run_epoch(net, 0)
    del net.m["p3"]
    net.held = []
    deeper = alloc(("p0",), ("p1",), ("p2",))  # three stages: no stage state fits it
    net.proposals = {p: deeper for p in net.m}
    for p in net.m:
        net.run_actions(p, net.m[p].replan(END + 1))
    for t in (FREEZE, STOP, DECIDE, ADOPT):
        net.tick(t + TIMING.period)
    assert all(m.committed.epoch == 0 and m.replanning is not None for m in net.m.values())
    assert all(m.stats["no_repair"] == 1 for m in net.m.values())
    votes = [a.payload for p in net.m for a in net.of(p, Publish) if a.kind == "vote"]
    assert not [v for v in votes if v.epoch == 1]


def test_messages_of_a_replan_epoch_wait_for_a_peer_that_has_not_re_planned_yet() -> None:
    net = four()
    net.start()
    run_epoch(net, 0)
    early = net.m["p0"].replan(END + 1)
    entry = next(a.payload for a in early if isinstance(a, Publish))
    before = net.m["p1"].stats["after_commit"]
    assert net.m["p1"].on_message(entry, END + 1) == []  # held, not rejected
    assert net.m["p1"].stats["after_commit"] == before
    net.m["p1"].replan(END + 2)
    assert "p0" in net.m["p1"]._epochs[1].entries


def test_a_replan_epoch_needs_a_majority_of_the_running_roster_for_a_while_then_only_its_view() -> None:
    cfg = ConsensusConfig(epoch0_start=T0, timing=TIMING, anchor_epochs=2)
    net = Net(["p0", "p1", "p2", "p3"], config=cfg)
    net.proposals = {p: BEST for p in net.m}
    net.start()
    run_epoch(net, 0)
    record = net.m["p0"].committed.record
    assert cfg.anchor(record, 1) == cfg.anchor(record, 2) == frozenset({"p0", "p1", "p2", "p3"})
    assert cfg.anchor(record, 3) == frozenset() and cfg.anchor(record, 0) == frozenset()
    # p1..p3 die; p0 re-plans with two newcomers: its view quorum (2 of 3) is there, the anchor
    # majority (3 of p0..p3) is not, so epochs 1 and 2 cannot commit; epoch 3 can
    for p in ("p1", "p2", "p3"):
        del net.m[p]
    for p in ("p4", "p5"):
        net.m[p] = ConsensusMachine(JOB, p, net.config, score, RosterDevice(20.0, 16 << 30))
        net.log[p] = []
    net.held = []
    net.proposals = {p: alloc(("p0",), ("p4",), spares=("p5",)) for p in net.m}
    net.now = END + 1
    net.run_actions("p0", net.m["p0"].replan(END + 1))
    for p in ("p4", "p5"):  # newcomers that adopted the old commit re-plan too
        net.m[p].committed = net.m["p0"].replanning
        net.run_actions(p, net.m[p].replan(END + 1))
    for e in (1, 2, 3):
        for t in (FREEZE, STOP, DECIDE, ADOPT, END):
            net.tick(t + (e - 1) * TIMING.period + TIMING.period)
    m = net.m["p0"]
    assert m.committed.epoch == 3, m.committed.epoch


def test_a_newcomer_that_re_plans_into_the_epoch_it_started_in_publishes_one_entry() -> None:
    """It started in epoch 1 (an entry), adopted the running commit of epoch 0, then its health
    check re-plans into epoch 1 again: a second, different entry would get it banned."""
    net = four()
    net.start()
    run_epoch(net, 0)
    record = net.m["p0"].committed.record
    m = ConsensusMachine(JOB, "p4", net.config, score, RosterDevice(20.0, 16 << 30))
    first = m.start(END + 1)
    assert [a.kind for a in first if isinstance(a, Publish)] == ["roster"]
    m.on_commit_record(record, END + 2)
    assert m.committed is not None and m.committed.epoch == 0
    again = m.replan(END + 3)
    assert m.epoch == 1 and not [a for a in again if isinstance(a, Publish) and a.kind == "roster"]


def test_a_late_re_planner_joins_the_epoch_the_others_re_plan_in_while_its_entry_still_counts() -> None:
    net = four()
    net.start()
    run_epoch(net, 0)
    start1 = net.config.start(1)
    early = net.m["p0"].replan(start1 + 1)  # p0's cause came first: it re-plans in epoch 1
    entry = next(a.payload for a in early if isinstance(a, Publish))
    assert entry.epoch == 1
    late = start1 + TIMING.roster_s + TIMING.max_skew_s / 2  # p1's roster window of epoch 1 passed
    assert net.m["p1"].on_message(entry, late) == []  # held: p0 re-plans already
    net.m["p1"].replan(late)
    assert net.m["p1"].epoch == 1 and "p0" in net.m["p1"]._epochs[1].entries
    # alone (no entry of the others waiting), the same moment goes on to epoch 2
    net.m["p2"].replan(late)
    assert net.m["p2"].epoch == 2
    # and past the skew margin an entry would no longer count: epoch 2 even with the others waiting
    too_late = start1 + TIMING.roster_s + TIMING.max_skew_s + 0.1
    assert net.m["p3"].on_message(entry, too_late) == []
    net.m["p3"].replan(too_late)
    assert net.m["p3"].epoch == 2
