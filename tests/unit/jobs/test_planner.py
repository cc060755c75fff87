"""The planning driver offline: several JobPlanners over an in-process DHT with lost reads, a simulated clock.

Real consensus machines, real islands (threads running the scheduler's search), real codecs;
only the DHT is an in-process dictionary (``MemoryDHT``) whose reads miss entries at random.
The clock is simulated: it advances one poll per round, but waits (in real time) for islands
that have not produced their first allocation, so results do not depend on machine load.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time

import pytest
from msgspec.structs import replace

from peerd.jobs.catalog import decode_votes, encode_votes
from peerd.jobs.planner import JobPlanner, PlannerConfig
from peerd.jobs.records import new_job_record
from peerd.jobs.scoring import RosterScorer
from peerd.jobs.spec import JobSpec, PlanningSpec, parse_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import (
    CommitRecord,
    Roster,
    RosterDevice,
    RosterEntry,
    RosterLink,
    Vote,
    decode,
    encode,
)
from peerd.swarm.keys import commit_key, roster_key, votes_key

T0 = 1_000_000.0
POLL = 0.5
ISLAND_START_S = 60.0  # hang guard only: a first population takes well under a second
PEERS = [f"Qm{c * 20}" for c in "abcdefghjk"]  # base58-safe, distinct


def spec(d_pp: int | str = 3, d_dp: int | str = 2, peers: int = 6) -> JobSpec:
    return parse_job_spec(
        {
            "name": "offline",
            "kind": "pretrain",
            "model": {"preset": "tiny"},
            "steps": 10,
            "global_batch": 16,
            "micro_batch": 4,
            "data": {"seq_len": 32},
            "parallel": {"d_pp": d_pp, "d_dp": d_dp},
            "min_peers": peers,
            "planning": {"time_budget_s": 4.0, "max_skew_s": 0.6},
        }
    )


class Swarm:
    """N planners of one job over one MemoryDHT, driven round by round."""

    def __init__(self, n: int, *, job_spec: JobSpec, miss: float = 0.3, seed: int = 0) -> None:
        self.clock = [T0]
        self.dht = MemoryDHT(lambda: self.clock[0], miss=miss, seed=seed)
        rng = random.Random(seed)
        self.peers = PEERS[:n]
        region = {p: rng.choice(["eu", "us", "asia"]) for p in self.peers}
        self.spec = job_spec
        self.job = new_job_record(
            self.peers[0],
            "default",
            job_spec,
            os.urandom(16),
            now=T0,
            epoch0_start=T0 + 1.0,
            timing=job_spec.planning.timing(),
        )
        self.commits: dict[str, list[Commit]] = {p: [] for p in self.peers}
        self.planners: dict[str, JobPlanner] = {}
        for i, p in enumerate(self.peers):
            links = tuple(
                RosterLink(
                    q,
                    0.002 if region[p] == region[q] else rng.uniform(0.02, 0.08),
                    2e9 if region[p] == region[q] else rng.choice([5e7, 2e8]),
                )
                for q in self.peers
                if q != p and rng.random() < 0.85  # some pairs unmeasured
            )
            profile = RosterDevice(rng.choice([0.05, 0.1, 0.2]), (4 + 2 * (i % 3)) << 30, region[p])
            self.planners[p] = JobPlanner(
                self.job,
                job_spec,
                self.dht.client(p),
                lambda profile=profile, links=links: (profile, links),
                config=PlannerConfig(poll_s=POLL),
                on_commit=self.commits[p].append,
            )

    async def run(
        self, until: float, stop_when_committed: bool = True, live: list[str] | None = None
    ) -> None:
        live = live or self.peers
        while self.clock[0] < until:
            for p in live:
                await self.planners[p].poll_once()
            await self.wait_for_islands(live)
            await asyncio.sleep(0.01)
            self.clock[0] += POLL
            if stop_when_committed and all(self.commits[p] for p in live):
                # a few more rounds: commit records propagate, late peers adopt them
                for _ in range(4):
                    for p in live:
                        await self.planners[p].poll_once()
                    self.clock[0] += POLL
                return

    async def wait_for_islands(self, live: list[str]) -> None:
        """Islands build their first population in real time (threads); the simulated clock waits for them."""
        deadline = time.monotonic() + ISLAND_START_S
        while not all(self.planners[p].island_started for p in live):
            if time.monotonic() > deadline:
                waiting = [p[:8] for p in live if not self.planners[p].island_started]
                pytest.fail(f"the islands of {waiting} built no first population within {ISLAND_START_S:g} s")
            await asyncio.sleep(0.02)

    def close(self) -> None:
        for planner in self.planners.values():
            planner.close()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("seed", [0, 1])
def test_six_peers_commit_one_allocation_no_worse_than_any_island(seed: int) -> None:
    swarm = Swarm(6, job_spec=spec(), miss=0.3, seed=seed)
    try:
        run(swarm.run(T0 + 120))
        hashes = {p: c[-1].allocation_hash for p, c in swarm.commits.items() if c}
        assert len(hashes) == 6, f"not every peer committed: {hashes}"
        assert len(set(hashes.values())) == 1
        commit = swarm.commits[swarm.peers[0]][-1]
        assert commit.allocation.d_pp == 3 and commit.allocation.d_dp == 2
        # the quorum's choice beats or ties every island's best (all re-scored by the shared cost model)
        islands = [
            r.best_cost
            for pl in swarm.planners.values()
            for r in pl.islands.values()
            if r.epoch == commit.epoch
        ]
        assert islands and all(c is not None for c in islands)
        assert commit.cost <= min(islands) * (1 + 1e-9)
        assert len(commit.record.votes) >= 4  # a quorum of the 6-peer view
        scorer = RosterScorer(swarm.spec)  # re-scoring the committed allocation on its candidate's roster
        stored = swarm.dht.data[roster_key(swarm.job.job_id, commit.epoch)]
        roster = Roster.of(commit.epoch, [decode(stored[p][0]) for p, _ in commit.record.roster])
        assert roster.refs == commit.record.roster
        assert scorer(roster, commit.allocation) == pytest.approx(commit.cost, rel=1e-9)
    finally:
        swarm.close()


def test_observer_commits_from_records_without_publishing() -> None:
    swarm = Swarm(7, job_spec=spec(peers=6), miss=0.2, seed=3)
    observer = swarm.peers[-1]
    swarm.planners[observer].participate = False
    # 6 participants plus an observer: the roster is 6, so shape 3x2 fits exactly
    try:
        run(swarm.run(T0 + 120))
        assert swarm.commits[observer], "the observer did not adopt the commit"
        hashes = {c[-1].allocation_hash for c in swarm.commits.values() if c}
        assert len(hashes) == 1
        job = swarm.job.job_id
        written = {k: set(v) for k, v in swarm.dht.data.items()}
        assert observer not in written.get(roster_key(job, 0), set())
        assert observer not in written.get(votes_key(job, 0), set())
        assert observer in written.get(commit_key(job), set())  # re-published proof heals DHT loss
    finally:
        swarm.close()


def test_a_peer_dropping_out_mid_round_does_not_split_the_commit() -> None:
    swarm = Swarm(7, job_spec=spec(d_pp=3, d_dp="auto", peers=6), miss=0.25, seed=5)
    dropped = swarm.peers[3]
    t = swarm.job.timing

    async def scenario() -> None:
        # run until the search started, then the peer vanishes (its store goes offline)
        await swarm.run(T0 + 1.0 + t.freeze + 1.0, stop_when_committed=False)
        swarm.planners[dropped].store.offline = True
        await swarm.run(T0 + 200, live=[p for p in swarm.peers if p != dropped])

    try:
        run(scenario())
        survivors = [p for p in swarm.peers if p != dropped]
        hashes = {swarm.commits[p][-1].allocation_hash for p in survivors if swarm.commits[p]}
        assert len(hashes) == 1, f"split or missing commits: {hashes}"
        assert all(swarm.commits[p] for p in survivors)
    finally:
        swarm.close()


def test_forged_messages_and_unauthenticated_commit_votes_are_ignored() -> None:
    swarm = Swarm(6, job_spec=spec(), miss=0.0, seed=7)
    job = swarm.job.job_id
    victim, forger = swarm.peers[1], swarm.peers[5]

    async def scenario() -> None:
        await swarm.run(T0 + 1.5, stop_when_committed=False)
        # the forger stores a roster entry naming the victim under its own subkey
        entry = RosterEntry(job, 0, victim, T0 + 1.2, RosterDevice(99.0, 1 << 40, "x"), ())
        await swarm.planners[forger].store.put(roster_key(job, 0), encode(entry), T0 + 10_000)
        await swarm.run(T0 + 120)

    try:
        run(scenario())
        assert sum(p.stats["bad_signature"] for p in swarm.planners.values()) > 0
        commit = swarm.commits[swarm.peers[0]][-1]
        # the committed view holds the victim's own entry, not the forged 99-TFLOPS one
        real = swarm.dht.data[roster_key(job, commit.epoch)][victim][0]
        assert dict(commit.record.roster)[victim] == hashlib.sha256(real).digest()
        # a commit record for an epoch-1 candidate whose votes nobody stored under votes_key
        cand = replace(commit.record.candidate, epoch=1)
        digest = commit.record.votes[0].roster_digest
        fake_votes = tuple(Vote(job, 1, 0, p, T0 + 200, cand.id, cand.cost, digest) for p in swarm.peers[:4])
        forged = CommitRecord(job, 1, 0, forger, swarm.clock[0], cand, commit.record.roster, fake_votes)
        before = {p: len(c) for p, c in swarm.commits.items()}
        run(swarm.planners[forger].store.put(commit_key(job), encode(forged), T0 + 100_000))
        run(swarm.run(swarm.clock[0] + 12, stop_when_committed=False))  # committed peers re-read every 5 s
        assert {p: len(c) for p, c in swarm.commits.items()} == before  # nobody adopted it
        rejected = sum(pl.machine.stats["bad_commit_record"] for pl in swarm.planners.values())
        assert rejected >= 5
    finally:
        swarm.close()


def test_votes_entry_round_trip_and_limits() -> None:
    vote = Vote("j", 0, 0, PEERS[0], T0, bytes(32), 1.0, bytes(32))
    raw = encode_votes([encode(vote), encode(replace(vote, round=1))])
    assert [decode(v) for v in decode_votes(raw)][1].round == 1
    from peerd.errors import ProtocolError

    for bad in (b"\xc0", encode_votes([]), encode_votes([encode(vote)] * 3), b"\x92\x01\x02"):
        with pytest.raises(ProtocolError):
            decode_votes(bad)


def test_planning_spec_timing_scales_with_clock_skew() -> None:
    default = PlanningSpec().timing()
    assert (default.roster_s, default.vote_s, default.max_skew_s) == (10.0, 10.0, 3.0)
    fast = PlanningSpec(time_budget_s=2.0, max_skew_s=0.6).timing()
    assert fast.vote_s == 2.0 and fast.search_s == 2.0
    fast.validate()


def test_committed_peers_see_a_re_plan_another_peer_began() -> None:
    """``health.following`` needs the roster entries of a re-plan: a committed planner reads the
    rosters a re-plan begun now would fill (every ``committed_poll_s``), so it learns that a peer
    re-plans even when its own view of the job gives it no cause."""
    swarm = Swarm(6, job_spec=spec(), miss=0.0, seed=4)
    try:
        run(swarm.run(T0 + 120))
        assert all(swarm.commits[p] for p in swarm.peers)
        mover, *others = swarm.peers
        assert all(not swarm.planners[p].others_replanning() for p in others)
        assert run(swarm.planners[mover].replan("a partner stopped answering", ()))

        async def rounds() -> None:
            for _ in range(int(2 * PlannerConfig().committed_poll_s / POLL) + 2):
                await swarm.planners[mover].poll_once()  # publishes its roster entry
                for p in others:
                    await swarm.planners[p].poll_once()
                swarm.clock[0] += POLL

        run(rounds())
        assert all(swarm.planners[p].others_replanning() == {mover} for p in others)
        assert all(not swarm.planners[p].replanning for p in others)  # they decide themselves
    finally:
        swarm.close()
