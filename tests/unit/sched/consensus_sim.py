"""Deterministic discrete-event simulator for planning consensus: N machines over a lossy, slow DHT.

The network model follows what a hivemind DHT does to records: a stored record stays
readable, but a reader's poll may miss it (``miss``), so it arrives after a few poll
intervals; deliveries may be duplicated and so reordered; records a peer stores in the
second before it crashes reach only some readers; clocks are skewed by up to
``skew_s``. Every message goes through the real msgpack codec. One peer may crash
mid-round, one may be byzantine (false low claimed costs, optionally equivocating votes).
Everything is driven by one ``random.Random(seed)``: the same seed replays exactly.

A partition (``partition_s > 0``) splits the peers into two seeded halves for that long,
starting around the re-plan (or epoch 0 without one); both halves keep running. Its split
and start come from a second stream seeded alike, so every other draw stays as it is
without a partition until the first delivery the partition cuts. A
delivery between the halves that falls into the partition is lost (``partition_drop``,
the default: roster entries, candidates and votes stored during it never reach the other
half, harsher than a DHT) or postponed to a poll after the heal (a DHT: the record stayed
stored, it was just unreachable). Commit records are postponed in both modes: they live
under ``commit_key(job)`` until the job ends and a committed driver re-reads that key
forever (``peerd.jobs.planner``), so even a real network partition cannot erase them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from msgspec.structs import replace

from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit, Migrate, NextEpoch, Publish, StartSearch, StopSearch
from peerd.sched.consensus.machine import ConsensusConfig, ConsensusMachine, ConsensusTiming
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    Roster,
    RosterDevice,
    RosterLink,
    Vote,
    decode,
    encode,
)

JOB = "job-sim"
D_PP, D_DP = 3, 3
C_DP, C_PP = 2e8, 5e7  # bytes: gradient share and activation traffic per iteration
WORK = 40.0  # TFLOP per stage per iteration

SIM_TIMING = ConsensusTiming(
    roster_s=4.0, settle_s=9.0, search_s=12.0, exchange_s=9.0, vote_s=9.0, adopt_s=9.0, publish_interval_s=2.0
)


# --- a small but real cost model on roster data ---------------------------------------------

_tables: dict[bytes, tuple[dict, dict, dict]] = {}


def _transfer_tables(roster: Roster) -> tuple[dict, dict, dict]:
    """Per-pair DP and PP transfer seconds and per-peer compute seconds, from the roster's entries.

    A pair measured in one direction only uses that value both ways; unmeasured pairs get
    a pessimistic default. Cached by roster digest (the same roster always scores the same).
    """
    got = _tables.get(roster.digest)
    if got is None:
        delay: dict[tuple[str, str], float] = {}
        bw: dict[tuple[str, str], float] = {}
        for e in roster.entries:
            for link in e.links:
                delay[e.peer, link.peer] = link.delay_s
                bw[e.peer, link.peer] = link.bandwidth_bps
        for (a, b), v in list(delay.items()):
            delay.setdefault((b, a), v)
            bw.setdefault((b, a), bw[a, b])
        peers = roster.peers
        pairs = [(a, b) for a in peers for b in peers if a != b]
        dp = {k: 2 * (delay.get(k, 0.2) + C_DP / D_DP * 8 / bw.get(k, 1e8)) for k in pairs}
        pp = {k: delay.get(k, 0.2) + C_PP * 8 / bw.get(k, 1e8) for k in pairs}
        got = (dp, pp, {e.peer: WORK / e.profile.tflops for e in roster.entries})
        _tables[roster.digest] = got
    return got


def sim_score(roster: Roster, alloc: Allocation) -> float:
    """DP (max over groups) + 2 × PP (bottleneck per stage boundary, fixed matching) + compute."""
    dp_t, pp_t, compute_t = _transfer_tables(roster)
    stages = alloc.stages
    dp = max(sum(dp_t[d, o] for o in stage if o != d) for stage in stages for d in stage)
    pp = sum(max(map(pp_t.__getitem__, zip(s0, s1, strict=True))) for s0, s1 in itertools.pairwise(stages))
    return dp + 2 * pp + max(compute_t[d] for d in alloc.devices)


def _random_allocation(rng: random.Random, peers: list[str]) -> Allocation:
    order = rng.sample(peers, len(peers))
    used, spares = order[: D_PP * D_DP], order[D_PP * D_DP :]
    stages = [used[i * D_DP : (i + 1) * D_DP] for i in range(D_PP)]
    return Allocation.from_plain(stages, spares)


def repair(previous: Allocation, roster: Roster) -> Allocation:
    """``previous`` with every peer off ``roster`` replaced by a free roster peer (lowest name first)."""
    alive = set(roster.peers)
    free = sorted(alive - set(previous.devices))
    stages = [[p if p in alive else free.pop(0) for p in stage] for stage in previous.stages]
    return Allocation.from_plain(stages, free)


def _neighbour(rng: random.Random, alloc: Allocation) -> Allocation:
    """Swap two devices (either may be a spare)."""
    flat = [list(s) for s in alloc.stages] + [list(alloc.spares)]
    cells = [(i, j) for i, row in enumerate(flat) for j in range(len(row))]
    (i1, j1), (i2, j2) = rng.sample(cells, 2)
    flat[i1][j1], flat[i2][j2] = flat[i2][j2], flat[i1][j1]
    return Allocation(tuple(tuple(r) for r in flat[:-1]), tuple(flat[-1]))


@dataclass
class Island:
    """(1+1) hill climbing with migrants: enough search to make candidates differ."""

    rng: random.Random
    roster: Roster
    best: Allocation
    cost: float
    running: bool = True

    @classmethod
    def start(cls, roster: Roster, seed: int, previous: Allocation | None = None) -> Island:
        """A random start; a re-plan starts from the repair of ``previous`` (as the planner seeds it)."""
        rng = random.Random(seed)
        alloc = _random_allocation(rng, list(roster.peers)) if previous is None else repair(previous, roster)
        return cls(rng, roster, alloc, sim_score(roster, alloc))

    def step(self, tries: int) -> bool:
        """A few hill-climbing moves; True if the best improved."""
        improved = False
        for _ in range(tries):
            cand = _neighbour(self.rng, self.best)
            cost = sim_score(self.roster, cand)
            if cost < self.cost:
                self.best, self.cost, improved = cand, cost, True
        return improved

    def migrate(self, alloc: Allocation, cost: float) -> None:
        if cost < self.cost:
            self.best, self.cost = alloc, cost


# --- the simulation ------------------------------------------------------------------------


@dataclass
class SimConfig:
    peers: int = 10
    miss: float = 0.25  # probability that one poll misses a record
    poll_s: float = 1.0
    dup: float = 0.1  # probability of a duplicate delivery
    skew_s: float = 3.0
    drop: float = 0.0  # probability a delivery never happens (beyond the DHT model)
    crash: bool = True  # one peer crashes at a random time in epoch 0
    byzantine: bool = True  # one peer claims false low costs
    equivocate: bool = False  # ... and sends different votes to different peers
    faulty: int = 0
    epochs: int = 4  # simulate at most this many epochs
    search_tries: int = 6  # island moves per tick
    replan: bool = False  # after the first commit, one allocated peer dies and the survivors re-plan
    kill_at: tuple[float, float] = (0.0, SIM_TIMING.period / 2)  # when, into epoch 1 (uniform draw)
    partition_s: float = 0.0  # the two halves cannot reach each other this long (0: no partition)
    partition_at: tuple[float, float] = (-4.0, 4.0)  # it starts this long after the kill (or epoch 0)
    partition_side: float = 0.5  # the share of peers in the first half (a seeded split)
    partition_drop: bool = True  # lose what crosses during it (True) or deliver it after the heal


@dataclass
class PeerState:
    name: str
    machine: ConsensusMachine
    offset: float
    crash_at: float = math.inf
    island: Island | None = None
    island_results: dict[int, float] = field(default_factory=dict)  # epoch -> final island cost
    commits: list[Commit] = field(default_factory=list)
    next_epochs: list[int] = field(default_factory=list)
    commit_at: list[float] = field(default_factory=list)  # sim time of each Commit
    next_epoch_at: list[float] = field(default_factory=list)  # sim time of each NextEpoch
    replanned_at: float | None = None  # sim time of its replan() call
    replanned_into: int | None = None  # the epoch that call joined


@dataclass
class SimResult:
    peers: dict[str, PeerState]
    survivors: list[str]  # honest peers that did not crash
    byzantine: str | None
    crashed: str | None
    killed: str | None  # the allocated peer that died after the first commit (replan runs)
    delivered: int
    dropped: int
    partition: tuple[float, float] | None = None  # sim time window of the partition
    halves: tuple[frozenset[str], frozenset[str]] | None = None
    cut: int = 0  # deliveries lost to the partition (drop) or postponed past its end (delay)


def run(seed: int, cfg: SimConfig | None = None) -> SimResult:
    cfg = cfg or SimConfig()
    rng = random.Random(seed)
    names = [f"peer{i:02d}" for i in range(cfg.peers)]
    regions = ["eu", "us", "asia"]
    region = {p: rng.choice(regions) for p in names}
    conf = ConsensusConfig(epoch0_start=1000.0, timing=SIM_TIMING, min_peers=D_PP * D_DP, faulty=cfg.faulty)
    byz = names[1] if cfg.byzantine else None
    crashed = names[2] if cfg.crash else None
    peers: dict[str, PeerState] = {}
    for p in names:
        links = tuple(
            RosterLink(
                q,
                0.005 if region[p] == region[q] else rng.uniform(0.03, 0.15),
                rng.choice([1e9, 2e9, 5e9]) if region[p] == region[q] else rng.choice([5e7, 1e8, 3e8]),
            )
            for q in names
            if q != p and rng.random() < 0.9  # a few pairs unmeasured
        )
        profile = RosterDevice(
            tflops=rng.choice([50.0, 100.0, 150.0]), memory_bytes=40 << 30, region=region[p]
        )
        m = ConsensusMachine(JOB, p, conf, sim_score, profile, links, seed=seed)
        peers[p] = PeerState(p, m, rng.uniform(-cfg.skew_s, cfg.skew_s))
    if crashed:
        peers[crashed].crash_at = conf.epoch0_start + rng.uniform(0.0, SIM_TIMING.period)

    queue: list[tuple[float, int, str, str, object]] = []
    seq = itertools.count()
    stats = {"delivered": 0, "dropped": 0, "cut": 0}
    window: tuple[float, float] | None = None  # the partition, once it is scheduled
    halves: tuple[frozenset[str], frozenset[str]] | None = None
    if cfg.partition_s > 0:  # its own stream: the other draws stay as without a partition
        prng = random.Random(f"partition/{seed}")
        order = prng.sample(names, len(names))
        k = min(len(names) - 1, max(1, round(cfg.partition_side * len(names))))
        halves = frozenset(order[:k]), frozenset(order[k:])
        side = {q: 0 if q in halves[0] else 1 for q in names}
        lag = prng.uniform(*cfg.partition_at)
        if not cfg.replan:
            window = (conf.epoch0_start + lag, conf.epoch0_start + lag + cfg.partition_s)
    decoded: dict[bytes, object] = {}

    def push(t: float, kind: str, peer: str, data: object = None) -> None:
        heapq.heappush(queue, (t, next(seq), kind, peer, data))

    def delay() -> float:
        d = rng.uniform(0.02, 0.5)
        while rng.random() < cfg.miss and d < 12:
            d += cfg.poll_s
        return d

    def publish(src: str, t: float, payload: object) -> None:
        if src == byz:
            payload = _corrupt(payload, rng)
        data = encode(payload)
        crash_soon = peers[src].crash_at - t < 1.0
        for q in names:
            if q == src:
                continue
            out = data
            if src == byz and cfg.equivocate and isinstance(payload, Vote) and names.index(q) % 2:
                out = encode(replace(payload, candidate=bytes(32)))
            if (crash_soon and rng.random() < 0.5) or rng.random() < cfg.drop:
                stats["dropped"] += 1
                continue
            push(t + delay(), "deliver", q, (src, out))
            if rng.random() < cfg.dup:
                push(t + delay(), "deliver", q, (src, out))

    def handle(st: PeerState, actions: list, t: float) -> None:
        for a in actions:
            if isinstance(a, Publish):
                publish(st.name, t, a.payload)
            elif isinstance(a, StartSearch):
                previous = st.machine.replanning.allocation if st.machine.replanning else None
                st.island = Island.start(a.roster, a.seed, previous)
                handle(st, st.machine.propose(st.island.best, t + st.offset), t)
            elif isinstance(a, Migrate) and st.island is not None:
                st.island.migrate(a.allocation, a.cost)
            elif isinstance(a, StopSearch) and st.island is not None:
                st.island.running = False
                st.island_results[a.epoch] = st.island.cost
            elif isinstance(a, Commit):
                st.commits.append(a)
                st.commit_at.append(t)
            elif isinstance(a, NextEpoch):
                st.next_epochs.append(a.epoch)
                st.next_epoch_at.append(t)
                st.island = None

    killed: str | None = None
    horizon = conf.start(cfg.epochs)
    for p in peers:
        start = conf.epoch0_start - 2.0 + rng.uniform(0, 1.5)
        push(start, "start", p)
    if cfg.replan:
        push(conf.start(1) + rng.uniform(*cfg.kill_at), "kill", names[0])
    while queue:
        t, _, kind, p, data = heapq.heappop(queue)
        if t > horizon:
            break
        st = peers[p]
        if t >= st.crash_at:
            continue
        now = t + st.offset
        if kind == "kill":
            honest = [q for q in names if q not in (byz, crashed)]
            committed = [peers[q].commits[-1] for q in honest if peers[q].commits]
            if not committed:
                continue
            victims = [q for q in committed[0].allocation.devices if q in honest]
            killed = rng.choice(victims)
            peers[killed].crash_at = t
            if halves is not None:
                window = (t + lag, t + lag + cfg.partition_s)
            for q in names:  # each survivor confirms the death on its own poll, seconds apart
                push(t + rng.uniform(2.0, 8.0), "replan", q)
        elif kind == "replan":
            handle(st, st.machine.replan(now), t)
            st.replanned_at, st.replanned_into = t, st.machine.epoch
            push(t + rng.uniform(0.7, 1.3), "tick", p)
        elif kind == "start":
            handle(st, st.machine.start(now), t)
            push(t + rng.uniform(0.7, 1.3), "tick", p)
        elif kind == "tick":
            if st.island is not None and st.island.running and st.island.step(cfg.search_tries):
                handle(st, st.machine.propose(st.island.best, now), t)
            handle(st, st.machine.on_tick(now), t)
            if not _settled(peers, t) or st.machine.replanning is not None:
                push(t + rng.uniform(0.7, 1.3), "tick", p)
        else:
            src, raw = data
            msg = decoded.get(raw)
            if msg is None:  # all readers get the same bytes; decode each record once
                msg = decoded[raw] = decode(raw)
            if window is not None and window[0] <= t < window[1] and side[src] != side[p]:
                stats["cut"] += 1
                if not cfg.partition_drop or isinstance(msg, CommitRecord):
                    push(window[1] + delay(), "deliver", p, data)  # read again once it heals
                continue
            stats["delivered"] += 1
            handle(st, st.machine.on_message(msg, now), t)
    survivors = [p for p in names if p not in (byz, crashed, killed)]
    return SimResult(
        peers,
        survivors,
        byz,
        crashed,
        killed,
        stats["delivered"],
        stats["dropped"],
        window,
        halves,
        stats["cut"],
    )


def _settled(peers: dict[str, PeerState], t: float) -> bool:
    """Stop ticking once every live peer committed a while ago (records have propagated)."""
    return all(st.commits or t >= st.crash_at for st in peers.values()) and all(
        t - st.commits[-1].record.issued_at > 20 for st in peers.values() if st.commits
    )


def _corrupt(payload: object, rng: random.Random) -> object:
    """The byzantine peer halves the cost it claims for its candidates."""
    if isinstance(payload, Candidate):
        return replace(payload, cost=payload.cost * 0.5)
    return payload
