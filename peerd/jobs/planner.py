"""The DHT driver of planning consensus: feeds ``ConsensusMachine`` from the DHT, carries out its actions.

One ``JobPlanner`` per (job, peer). Every ``poll_s`` it offers the island's best to the
machine, ticks the machine, reads the keys the current phase needs (roster entries until the
view freezes, candidates while searching and deciding, votes from the decision on, commit
records always) and hands every new, authentic message in. Authentic means: the message's
``peer`` / ``author`` / ``voter`` is the peer whose owner subkey it was stored under (hivemind
verified the signature); the votes embedded in a commit record count only if the same bytes
were found under their voters' subkeys of ``votes_key``. Actions: ``Publish`` -> a store under
this peer's subkey (retried until it lands), ``StartSearch`` -> an island thread seeded by the
machine (hash of job, epoch, peer), ``Migrate`` -> a migrant for it, ``StopSearch`` -> stop and
log the island's result, ``Commit`` -> ``on_commit``, ``Misbehaviour`` -> ignore that peer for
the rest of the job. Wire layout and expirations: ``protocols/jobs.md``.

``replan(cause, held)`` re-plans a committed job (the manager calls it when the health
verdict says so): the machine joins a new epoch with this peer's held stage state, and
the driver seeds that epoch with repairs of the running allocation (``recovery.
patch_allocation``), so the hysteresis vote has the cheap fix to choose. After any commit,
``committed_roster`` gives the committed roster's entries (the resume step is theirs).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from peerd.errors import PeerdError, ProtocolError
from peerd.jobs.catalog import decode_votes, encode_votes
from peerd.jobs.island import IslandReport, IslandThread
from peerd.jobs.records import JobRecord
from peerd.jobs.recovery import cheapest_repair, patch_allocation, target_width
from peerd.jobs.scoring_rl import scorer_for
from peerd.jobs.spec import JobSpec
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import (
    Action,
    Commit,
    Migrate,
    Misbehaviour,
    NextEpoch,
    Publish,
    StartSearch,
    StopSearch,
)
from peerd.sched.consensus.machine import ConsensusConfig, ConsensusMachine
from peerd.sched.consensus.messages import (
    CommitRecord,
    HeldState,
    Message,
    RosterDevice,
    RosterEntry,
    RosterLink,
    Vote,
    decode,
    encode,
)
from peerd.sched.placement import placement_seed, random_allocation
from peerd.sched.problem import Shape
from peerd.swarm.keys import candidates_key, commit_key, roster_key, votes_key

logger = get_logger(__name__)

LocalInfo = Callable[[], tuple[RosterDevice, tuple[RosterLink, ...]]]


@dataclass(frozen=True)
class PlannerConfig:
    """Driver knobs (not protocol parameters: those come from the job record)."""

    poll_s: float = 1.0
    """Seconds between polls of the DHT (the machine is ticked as often)."""
    keep_s: float = 600.0
    """Roster entries, candidates and votes outlive their epoch by this much."""
    commit_ttl_s: float = 24 * 3600.0
    """Lifetime of commit records (re-stored by the runner while the job runs)."""
    committed_poll_s: float = 5.0
    """After a commit only newer commit records matter: read them this often."""
    island_patience: int = 25
    """Generations without improvement (and no migrant) before an island idles."""


def author_of(msg: Message) -> str:
    if isinstance(msg, RosterEntry):
        return msg.peer
    if isinstance(msg, Vote):
        return msg.voter
    return msg.author


class JobPlanner:
    """Plans one job on this peer: ``await run()`` until cancelled; ``committed`` once decided."""

    def __init__(
        self,
        job: JobRecord,
        spec: JobSpec,
        store: RecordStore,
        local: LocalInfo,
        *,
        participate: bool = True,
        config: PlannerConfig | None = None,
        on_commit: Callable[[Commit], None] | None = None,
    ) -> None:
        self.job, self.spec, self.store, self.local = job, spec, store, local
        self.participate = participate
        self.config = config or PlannerConfig()
        self.on_commit = on_commit
        self.scorer = scorer_for(spec)
        self.consensus = ConsensusConfig(job.epoch0_start, job.timing, min_peers=spec.min_peers)
        profile, links = local()
        self.machine = ConsensusMachine(job.job_id, store.me, self.consensus, self.scorer, profile, links)
        self.committed: Commit | None = None
        self.committed_at: float | None = None  # DHT time this peer committed
        self.islands: dict[int, IslandReport] = {}
        self.stats: Counter[str] = Counter()
        self.banned: set[str] = set()
        self.regions: dict[str, str] = {store.me: profile.region}  # peer -> region, from roster entries
        self._island: IslandThread | None = None
        self._island_roster: Any = None
        self._proposed = 0
        self._fed: set[bytes] = set()  # raw bytes already handed to the machine
        self._decoded: dict[bytes, Message | None] = {}
        self._votes: dict[tuple[int, str], set[bytes]] = {}  # (epoch, voter) -> authentic vote bytes
        self._my_votes: dict[int, list[bytes]] = {}
        self._fed_commits: set[tuple] = set()
        self._last_expiry: dict[str, float] = {}
        self._pending: dict[str, tuple[bytes, float]] = {}  # stores that did not land yet
        self._last_commit_read = -math.inf
        self._started = False
        self.replans: list[dict[str, Any]] = []  # each re-plan: epoch from, cause, when (DHT time)

    # -- driving --------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.poll_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # a bug must not end planning: the message that hit it is marked fed and not retried
                    self.stats["poll_failed"] += 1
                    if self.stats["poll_failed"] <= 3:
                        logger.exception("job %s: a planning poll failed", self.job.job_id)
                await asyncio.sleep(self.config.poll_s)
        finally:
            self.close()

    def close(self) -> None:
        if self._island is not None:
            self._island.stop()
            self._island = None

    async def poll_once(self) -> None:
        """One round: propose, tick, read and feed, retry stores. Network errors only skip this round."""
        now = self.store.now()
        if not self._started:
            self._started = True
            await self._handle(self.machine.start(now))
        self.machine.set_local(*self.local())
        await self._propose(now)
        await self._handle(self.machine.on_tick(now))
        try:
            await self._read(self.store.now())
        except PeerdError as exc:
            self.stats["read_failed"] += 1
            logger.debug("job %s: reading consensus records failed: %s", self.job.job_id, exc)
        await self._retry_pending()

    async def replan(self, cause: str, held: tuple[HeldState, ...] = ()) -> bool:
        """Re-plan the committed allocation (``cause`` in words); False if not committed or already re-planning."""
        now = self.store.now()
        self.machine.set_held(held)
        actions = self.machine.replan(now)
        if not actions:
            return False
        previous = self.machine.replanning
        assert previous is not None
        self.replans.append(
            {"from_epoch": previous.epoch, "epoch": self.machine.epoch, "cause": cause, "at": now}
        )
        logger.warning("job %s: re-planning (epoch %d): %s", self.job.job_id, self.machine.epoch, cause)
        await self._handle(actions)
        return True

    def others_replanning(self) -> frozenset[str]:
        """Peers that entered a re-plan of the committed allocation this peer has not joined yet."""
        return self.machine.ahead_peers()

    @property
    def replanning(self) -> bool:
        return self.machine.replanning is not None

    async def committed_roster(self, commit: Commit) -> list[RosterEntry] | None:
        """The entries of ``commit``'s roster (from this peer's view, else read from the DHT); None if some are missing."""
        wanted = dict(commit.record.roster)
        found: dict[str, RosterEntry] = {}
        es = self.machine._epochs.get(commit.epoch)
        if es is not None:
            found = {p: e for p, e in es.entries.items() if wanted.get(p) == e.hash}
        if len(found) < len(wanted):
            try:
                entries = await self.store.read(roster_key(self.job.job_id, commit.epoch))
            except PeerdError as exc:
                logger.debug("job %s: reading the committed roster failed: %s", self.job.job_id, exc)
                entries = []
            for entry in entries:
                msg = self._decode(entry.value)
                if (
                    isinstance(msg, RosterEntry)
                    and self._authentic(msg, entry.author)
                    and wanted.get(msg.peer) == msg.hash
                ):
                    found[msg.peer] = msg
        if len(found) < len(wanted):
            return None
        return [found[p] for p in sorted(found)]

    async def _propose(self, now: float) -> None:
        if self._island is None:
            return
        version, best = self._island.best()
        if best is not None and version != self._proposed:
            self._proposed = version
            await self._handle(self.machine.propose(best, now))

    # -- reading --------------------------------------------------------------------------------

    async def _read(self, now: float) -> None:
        """Read the keys this phase needs in one lookup (a loaded DHT answers slowly), then feed in order."""
        job, t = self.job.job_id, self.consensus.timing
        keys: list[str] = []
        epoch = self.machine.epoch
        if self.machine.planning and epoch >= 0:
            at = now - self.consensus.start(epoch)
            if at < t.freeze + t.max_skew_s:
                keys.append(roster_key(job, epoch))
            if at >= t.freeze - t.max_skew_s:
                keys.append(candidates_key(job, epoch))
            if at >= t.decide - t.max_skew_s:
                keys.append(votes_key(job, epoch))
            keys.append(commit_key(job))
        elif now - self._last_commit_read >= self.config.committed_poll_s:
            keys.append(commit_key(job))
            if (committed := self.machine.committed) is not None:
                # the rosters a re-plan begun by others would fill now: their entries wait in the
                # machine (``ahead_peers``) so that this peer follows (``health.following``) even
                # when its own view of the job's records gives it no cause of its own
                newest = self.consensus.replan_epoch(now, committed.epoch)
                keys += [roster_key(job, e) for e in (newest - 1, newest) if e > committed.epoch]
        if not keys:
            return
        try:
            results = await self.store.read_many(keys)  # one DHT traversal for all of them
        except PeerdError as exc:
            self.stats["read_failed"] += 1
            logger.debug("job %s: reading %s failed: %s", job, ", ".join(keys), exc)
            return
        for key, found in results.items():
            now = self.store.now()
            if key == commit_key(job):
                await self._feed_commits(found, now)
            elif key == votes_key(job, epoch):
                await self._feed_votes(found, epoch, now)
            else:
                await self._feed_entries(found, now)

    async def _feed_entries(self, entries: list[Any], now: float) -> None:
        for entry in entries:
            if entry.value in self._fed or entry.author in self.banned:
                continue
            msg = self._decode(entry.value)
            if msg is None or not self._authentic(msg, entry.author):
                continue
            self._fed.add(entry.value)
            if isinstance(msg, RosterEntry):
                self.regions[msg.peer] = msg.profile.region
            await self._handle(self.machine.on_message(msg, now))

    async def _read_votes(self, epoch: int, now: float) -> None:
        await self._feed_votes(await self.store.read(votes_key(self.job.job_id, epoch)), epoch, now)

    async def _feed_votes(self, entries: list[Any], epoch: int, now: float) -> None:
        for entry in entries:
            if entry.value in self._fed or entry.author in self.banned:
                continue
            self._fed.add(entry.value)
            try:
                items = decode_votes(entry.value)
            except ProtocolError as exc:
                self.stats["bad_votes_entry"] += 1
                logger.debug("job %s: votes of %s: %s", self.job.job_id, entry.author, exc)
                continue
            for raw in items:
                vote = self._decode(raw)
                if (
                    not isinstance(vote, Vote)
                    or vote.epoch != epoch
                    or not self._authentic(vote, entry.author)
                ):
                    continue
                self._votes.setdefault((epoch, vote.voter), set()).add(raw)
                if raw not in self._fed:
                    self._fed.add(raw)
                    await self._handle(self.machine.on_vote(vote, now))

    async def _feed_commits(self, entries: list[Any], now: float) -> None:
        self._last_commit_read = now
        for entry in entries:
            if entry.author in self.banned:
                continue
            record = self._decode(entry.value)
            if not isinstance(record, CommitRecord) or not self._authentic(record, entry.author):
                continue
            if self.machine.committed is not None and record.epoch <= self.machine.committed.epoch:
                continue
            votes = self._authentic_votes(record)
            if len(votes) < len(record.votes):  # some embedded votes not seen yet: read their key once
                await self._read_votes(record.epoch, now)
                votes = self._authentic_votes(record)
            key = (
                entry.author,
                record.epoch,
                record.round,
                record.candidate.id,
                frozenset(encode(v) for v in votes),
            )
            if key in self._fed_commits:
                continue
            self._fed_commits.add(key)
            await self._handle(self.machine.on_commit_record(replace(record, votes=tuple(votes)), now))

    def _authentic_votes(self, record: CommitRecord) -> list[Vote]:
        return [v for v in record.votes if encode(v) in self._votes.get((record.epoch, v.voter), set())]

    def _decode(self, raw: bytes) -> Message | None:
        if raw in self._decoded:
            return self._decoded[raw]
        try:
            msg: Message | None = decode(raw)
        except ProtocolError as exc:
            self.stats[f"undecodable_{exc.code.name.lower()}"] += 1
            msg = None
        if len(self._decoded) > 20000:  # bounded memory over a long planning
            self._decoded.clear()
        self._decoded[raw] = msg
        return msg

    def _authentic(self, msg: Message, author: str) -> bool:
        if author_of(msg) != author:
            self.stats["bad_signature"] += 1  # stored under someone else's subkey: a forgery
            return False
        return True

    # -- actions --------------------------------------------------------------------------------

    async def _handle(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Publish):
                await self._publish(action)
            elif isinstance(action, StartSearch):
                if self.spec.planning.placement == "random":  # the baseline: no search, a seeded order
                    await self._propose_random(action)
                else:
                    self._start_island(action)
                await self._propose_repairs(action)
            elif isinstance(action, Migrate):
                if self._island is not None and self._island.report.epoch == action.epoch:
                    self._island.offer(action.allocation)
            elif isinstance(action, StopSearch):
                self._stop_island(action.epoch)
            elif isinstance(action, Commit):
                self._committed(action)
            elif isinstance(action, NextEpoch):
                self._stop_island(action.epoch - 1)
                logger.info("job %s: planning moves to epoch %d", self.job.job_id, action.epoch)
            elif isinstance(action, Misbehaviour):
                self.banned.add(action.peer)
                self.stats["banned"] += 1
                logger.warning(
                    "job %s: ignoring peer %s from now on: %s", self.job.job_id, action.peer, action.what
                )

    async def _publish(self, action: Publish) -> None:
        msg, job, c = action.payload, self.job.job_id, self.config
        if action.kind == "commit":
            await self._put(commit_key(job), encode(msg), self.store.now() + c.commit_ttl_s)
            return
        if not self.participate:
            return  # an observer keeps its roster entry, candidates and votes to itself
        end = self.consensus.start(msg.epoch + 1) + c.keep_s
        if isinstance(msg, Vote):  # a commit record is proved by votes: they live as long as it does
            end = max(end, self.store.now() + c.commit_ttl_s)
        if action.kind == "roster":
            await self._put(roster_key(job, msg.epoch), encode(msg), end)
        elif action.kind == "candidate":
            await self._put(candidates_key(job, msg.epoch), encode(msg), end)
        elif isinstance(msg, Vote):
            mine = self._my_votes.setdefault(msg.epoch, [])
            raw = encode(msg)
            mine.append(raw)
            self._votes.setdefault((msg.epoch, msg.voter), set()).add(raw)
            await self._put(votes_key(job, msg.epoch), encode_votes(mine), end)

    async def _put(self, key: str, value: bytes, expires_at: float) -> None:
        # hivemind replaces an entry only by one that expires later: keep expirations increasing
        expires_at = max(expires_at, self._last_expiry.get(key, -math.inf) + 1e-3)
        self._last_expiry[key] = expires_at
        self._pending.pop(key, None)
        try:
            ok = await self.store.put(key, value, expires_at)
        except PeerdError as exc:
            logger.debug("job %s: store of %s failed: %s", self.job.job_id, key, exc)
            ok = False
        if not ok:
            self.stats["store_retry"] += 1
            self._pending[key] = (value, expires_at)

    async def _retry_pending(self) -> None:
        for key, (value, _) in list(self._pending.items()):
            expires = self._last_expiry[key] + 1e-3
            self._last_expiry[key] = expires
            try:
                ok = await self.store.put(key, value, expires)
            except PeerdError:
                ok = False
            if ok:
                self._pending.pop(key, None)

    def _start_island(self, action: StartSearch) -> None:
        self._stop_island(None)
        t = self.consensus.timing
        # stop a little before the machine does, so the final best reaches propose() in time
        deadline = self.consensus.start(action.epoch) + t.stop - 1.5 * self.config.poll_s
        budget = deadline - self.store.now()
        roster = action.roster
        self._island_roster = roster
        scenario = self.scorer.scenario(roster)  # built here, on the loop; the thread only reads it
        self._island = IslandThread(
            lambda: self.scorer.island(scenario, action.seed, budget),
            epoch=action.epoch,
            seed=action.seed,
            deadline=deadline,
            clock=self.store.now,
            patience=self.config.island_patience,
        )
        self.islands[action.epoch] = self._island.report
        self._proposed = 0
        self._island.start()
        logger.info(
            "job %s epoch %d: searching on a roster of %d peers (seed %d)",
            self.job.job_id,
            action.epoch,
            len(roster.entries),
            action.seed,
        )

    async def _propose_random(self, action: StartSearch) -> None:
        """``planning.placement: random``: the one allocation every peer derives from public data."""
        p, shape = self.spec.planning, self.spec.parallel.known()
        seed = placement_seed(
            self.job.job_id, p.placement_seed
        )  # not the epoch: a re-plan on the same roster keeps it
        allocation = random_allocation(action.roster.peers, Shape(shape["d_pp"], shape["d_dp"]), seed)
        await self._handle(self.machine.propose(allocation, self.store.now()))

    async def _propose_repairs(self, action: StartSearch) -> None:
        """In a re-plan epoch: offer a repair of the running allocation as a candidate.

        With a fixed ``d_dp``, the widest repair that scores (back to that width when the
        roster allows: it loses the least throughput). With ``auto``, the cheapest one, but
        a wider one than the running width only if it gains ``replan_margin``: a newcomer
        that does not speed the job up waits as a spare instead of reshaping it.
        """
        running = self.machine.replanning
        if running is None:
            return
        previous = running.allocation
        if self.spec.kind == "rl":
            target = 1  # no wider than the running trainers; the spares roll out
        else:
            target = (
                target_width(self.spec.parallel.d_dp, self.spec.max_peers, previous.d_pp) or previous.d_dp
            )
        widths = range(max(target, previous.d_dp), 0, -1)
        fixed = isinstance(self.spec.parallel.d_dp, int)
        scored: list[tuple[float, Allocation]] = []
        for allocation in patch_allocation(previous, action.roster.entries, widths):
            try:
                scored.append((self.scorer(action.roster, allocation), allocation))
            except PeerdError as exc:
                logger.debug("job %s: repair %s not scorable: %s", self.job.job_id, allocation.stages, exc)
                continue
            if fixed:
                break  # widest first
        if not scored:
            return
        cost, choice = (
            scored[0] if fixed else cheapest_repair(scored, previous.d_dp, self.consensus.replan_margin)
        )
        logger.info(
            "job %s epoch %d: proposing the repair %s (%.4g s/step)",
            self.job.job_id,
            action.epoch,
            choice.stages,
            cost,
        )
        await self._handle(self.machine.propose(choice, self.store.now()))
        if self._island is not None:
            self._island.offer(choice)

    def _stop_island(self, epoch: int | None) -> None:
        island = self._island
        if island is None or (epoch is not None and island.report.epoch != epoch):
            return
        island.stop()
        self._island = None
        _, best = island.best()
        report = island.report
        if best is not None:
            try:
                report.best_cost = self.scorer(self._island_roster, best)
            except PeerdError as exc:
                report.error = str(exc)
        logger.info(
            "job %s epoch %d: island best %s after %d generations (%d evaluations, %d/%d migrants taken)",
            self.job.job_id,
            report.epoch,
            f"{report.best_cost:.6g}" if report.best_cost is not None else "-",
            report.generations,
            report.evaluations,
            report.migrants_taken,
            report.migrants_offered,
        )

    def _committed(self, commit: Commit) -> None:
        self._stop_island(None)
        self.committed = commit
        self.committed_at = self.store.now()
        logger.info(
            "job %s: committed allocation %s (epoch %d, round %d, cost %.6g)",
            self.job.job_id,
            commit.allocation_hash[:12],
            commit.epoch,
            commit.round,
            commit.cost,
        )
        if self.on_commit is not None:
            self.on_commit(commit)

    @property
    def island_started(self) -> bool:
        """False while this peer's island is still building its first population (simulated clocks wait for it)."""
        island = self._island
        return island is None or island.best()[0] > 0 or not island.running

    # -- views ----------------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """JSON-able planning state for ``peerd status``."""
        m, c = self.machine, self.committed
        out: dict[str, Any] = {
            "epoch": m.epoch,
            "participant": self.participate,
            "islands": [r.to_dict() for _, r in sorted(self.islands.items())],
            "rejected": dict(m.stats),
            "driver": dict(self.stats),
            "banned": sorted(self.banned),
            **({"roster": {"epoch": r[0], "peers": r[1]}} if (r := m.last_roster) else {}),
            "replanning": self.replanning,
            "replans": list(self.replans),
        }
        if c is not None:
            out["commit"] = commit_view(c)
            out["committed_at"] = self.committed_at
            t, start = self.consensus.timing, self.consensus.start(c.epoch)
            out["roster_closed_at"] = start + t.roster_s
            out["votes_opened_at"] = start + t.decide
        return out


def commit_view(c: Commit) -> dict[str, Any]:
    alloc = c.allocation.canonical()
    return {
        "epoch": c.epoch,
        "round": c.round,
        "allocation_hash": c.allocation_hash,
        "candidate_id": c.candidate_id,
        "cost": c.cost,
        "stages": [list(s) for s in alloc.stages],
        "pipelines": alloc.pipelines(),
        "layers": list(alloc.layers) if alloc.layers is not None else None,
        "spares": list(alloc.spares),
        "votes": len(c.record.votes),
        "roster": [p for p, _ in c.record.roster],
    }
