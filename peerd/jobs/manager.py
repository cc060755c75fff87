"""One daemon's jobs kept in step with the swarm's records: discovery, a planner and a tasklet per job, owner duties.

``JobManager.run()`` loops every ``discover_s``: read the owners' job indexes of this swarm,
the job records they name (only the owner's own record counts, see ``catalog``), and for
every live job keep one ``JobPlanner`` (participating when this peer is eligible) and, once
an allocation that includes this peer is committed, one runner (``peerd.jobs.roles.JobRunner``: a
pipeline tasklet's ``TaskletRunner``, an rl job's ``RLRunner``) that adopts every
later commit too. Each round also reads the job's progress records and asks
``health.assess`` whether a tasklet's peer is gone or the pipeline is stuck; if so this peer
freezes its tasklet and re-plans (``JobPlanner.replan`` with the state it holds): every
peer reaches the same verdict from the same records, and the consensus picks the repair.
``drain`` (leave) and ``pause`` hand this peer's tasklets over: they publish ``left``, the
others re-plan without it, and it keeps serving its stage's state meanwhile. A job's state as
everyone sees it is derived from public records (``effective_state``); the owner's daemon
writes it back into the job record, re-stores its records before they expire, and is the
only one whose ``cancel`` counts. The control endpoint's submit/cancel/jobs/job_status are
methods here; ``JobEntry``, the effective state and the views are in ``jobs.views``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from peerd.errors import ConfigError, ErrorCode, PeerdError, ProtocolError
from peerd.jobs import catalog
from peerd.jobs.health import (
    GrowthLedger,
    HealthConfig,
    StallWatch,
    assess,
    following,
    settled_newcomers,
    short_handed,
)
from peerd.jobs.planner import JobPlanner, LocalInfo, PlannerConfig
from peerd.jobs.records import (
    NONCE_BYTES,
    TERMINAL,
    JobIndex,
    JobRecord,
    JobState,
    TaskState,
    encode_index,
    encode_job,
    new_job_record,
)
from peerd.jobs.recovery import target_width
from peerd.jobs.regime import activation_regime
from peerd.jobs.roles import JobRunner
from peerd.jobs.runner import tasklet_of, unsupported
from peerd.jobs.scoring import job_model
from peerd.jobs.spec import JobSpec, parse_job_spec, pin_examples
from peerd.jobs.store import Prefetched, RecordStore
from peerd.jobs.views import (
    JobEntry,
    effective_state,
    failure_reason,
    job_view,
    merge_final_records,
    records_complete,
    remember_curve,
    resolve_job_id,
    start_warnings,
)
from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import HeldState
from peerd.swarm.keys import job_key, jobs_key, progress_key
from peerd.tasks import cancel_and_wait, within

logger = get_logger(__name__)

RunnerFactory = Callable[[JobRecord, JobSpec], JobRunner]
SUBMIT_TRIES = 3
FINAL_READS = 5  # reads of an ended job's progress records before this daemon settles for what it has
SUBMIT_RETRY_S = 1.0  # seconds before the second try, twice that before the third


@dataclass(frozen=True)
class ManagerConfig:
    discover_s: float = 2.0
    """Seconds between reads of the job indexes and records."""
    lead_s: float = 6.0
    """Planning epoch 0 opens this long after a submit: every daemon discovers the job first."""
    record_ttl_s: float = 24 * 3600.0
    """Lifetime of job records and indexes in the DHT (the owner re-stores them)."""
    refresh_s: float = 600.0
    """The owner re-stores its job records and index this often."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    roster_retry_s: float = 1.0
    """A commit's roster entries not all readable yet: retry this often (they propagate)."""
    max_jobs: int | None = None
    """Live jobs this peer may hold a tasklet (or rollout role) in: holding that many, it applies to no
    other job's roster (None: no limit). Planning alone holds nothing, so a job that never commits
    takes no slot."""


def eligible(job_id: str, me: str, online: list[str], max_peers: int | None) -> bool:
    """Whether this peer applies for the roster: all do, unless ``max_peers`` caps it (lowest hash ranks first)."""
    if max_peers is None or len(online) <= max_peers:
        return True
    rank = sorted(set(online) | {me}, key=lambda p: hashlib.sha256(f"{job_id}|{p}".encode()).digest())
    return me in rank[:max_peers]


class JobManager:
    """Jobs as one daemon sees and runs them; drive with ``await run()``."""

    def __init__(
        self,
        store: RecordStore,
        swarm: str,
        *,
        local: LocalInfo,
        online: Callable[[], list[str]],
        runner_factory: RunnerFactory | None = None,
        config: ManagerConfig | None = None,
    ) -> None:
        self.store, self.swarm, self.local, self.online = store, swarm, local, online
        self.runner_factory = runner_factory
        self.config = config or ManagerConfig()
        self.jobs: dict[str, JobEntry] = {}
        self.my_jobs: list[str] = []  # ids this peer owns, oldest first
        self.rejected = catalog.Rejections()
        self._index_stored_at = 0.0
        self._expiry: dict[str, float] = {}
        self._discovering = asyncio.Lock()
        self.unusable: set[str] = set()  # jobs whose spec this peer cannot use (logged once)
        self.over_capacity: set[str] = set()  # jobs not applied to because max_jobs others run here
        self.paused: str | None = None  # why this peer handed its tasklets over and applies for none
        self.leaving = False
        self._recovering_since: dict[str, dict[tuple[int, str], float]] = {}  # job -> (epoch, peer) -> t
        self._online_since: dict[str, float] = {}  # peer -> when this daemon first saw it online
        self._growth_ledgers: dict[str, GrowthLedger] = {}  # job -> newcomers its growth re-plans were for
        self._stalls: dict[str, StallWatch] = {}  # job -> the committed epoch's step clock
        self._adopting: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()

    @property
    def me(self) -> str:
        return self.store.me

    # -- control methods ------------------------------------------------------------------------

    async def submit(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validate ``params["spec"]`` (a mapping), sign and publish it; returns the job id."""
        spec = parse_job_spec(params.get("spec"), source=str(params.get("source") or "spec"))
        job_model(spec)  # the planner can size it (ConfigError otherwise)
        errors, warnings = unsupported(spec)
        if errors:
            raise errors[0]
        warnings = [*warnings, *start_warnings(spec, self._online_with_me())]
        if spec.prices_visits and spec.planning.examples is None:  # ``peerd submit`` counted them
            try:
                spec = await asyncio.get_running_loop().run_in_executor(None, pin_examples, spec)
            except ConfigError as exc:  # the tasklets read the corpus again, and say what is wrong
                warnings.append(
                    f"could not count the training examples here ({exc}): priced as a single pass"
                )
        regime = activation_regime(spec)
        now = self.store.now()
        nonce = os.urandom(NONCE_BYTES)
        record = new_job_record(
            self.me,
            self.swarm,
            spec,
            nonce,
            now=now,
            epoch0_start=now + self.config.lead_s,
            timing=spec.planning.timing(),
        )
        entry = JobEntry(record, spec)
        self.jobs[record.job_id] = entry
        self.my_jobs.append(record.job_id)
        if not await self._store_tries(entry, index=True):
            raise PeerdError(
                f"no DHT node accepted the job record ({SUBMIT_TRIES} tries); is this peer connected?",
                code=ErrorCode.PEER_UNAVAILABLE,
            )
        logger.info("submitted job %s (%s)", record.job_id, spec.name or "unnamed")
        self._wake.set()
        return {
            "job_id": record.job_id,
            "epoch0_start": record.epoch0_start,
            "owner": self.me,
            "name": spec.name,
            "warnings": warnings,
            "regime": regime.describe() if regime is not None else None,
        }

    async def cancel(self, params: dict[str, Any]) -> dict[str, Any]:
        """Cancel a job this peer owns; NOT_OWNER for anybody else's."""
        entry = await self.find(params.get("job_id"))
        rec = entry.record
        if rec.owner != self.me:
            raise ProtocolError(
                f"job {rec.job_id} belongs to {rec.owner}; only its owner may cancel it (this peer is {self.me})",
                code=ErrorCode.NOT_OWNER,
            )
        if rec.state in TERMINAL:
            return {"job_id": rec.job_id, "state": rec.state.value, "changed": False}
        entry.record = rec.with_state(JobState.CANCELLED, self.store.now(), str(params.get("reason") or ""))
        if not await self._store_tries(entry):
            # the record stays cancelled here and this daemon re-stores it every refresh
            raise PeerdError(
                f"no DHT node accepted the cancel record ({SUBMIT_TRIES} tries); this daemon keeps"
                " storing it, so the other peers will still read it; is this peer connected?",
                code=ErrorCode.PEER_UNAVAILABLE,
            )
        # the jobs loop stops this peer's planner and tasklets (as on every peer that reads the
        # record): closing streams and averaging groups can take tens of seconds on a loaded
        # machine, longer than a control call should wait for its answer
        self._wake.set()
        logger.info("cancelled job %s", rec.job_id)
        return {"job_id": rec.job_id, "state": JobState.CANCELLED.value, "changed": True}

    async def list_jobs(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        if params.get("refresh", True):
            with contextlib.suppress(PeerdError):
                await self.discover()
        return self.views(detail=False)

    async def job_status(self, params: dict[str, Any]) -> dict[str, Any]:
        entry = await self.find(params.get("job_id"))
        return self._view(entry, self.store.now(), detail=True, online=self._online_with_me())

    def views(self, detail: bool = True) -> list[dict[str, Any]]:
        now, online = self.store.now(), self._online_with_me()
        entries = sorted(self.jobs.values(), key=lambda e: e.record.created_at, reverse=True)
        return [self._view(e, now, detail=detail, online=online) for e in entries]

    def _view(self, entry: JobEntry, now: float, *, detail: bool, online: set[str]) -> dict[str, Any]:
        view = job_view(entry, self.me, now, detail=detail, online=online)
        if entry.record.job_id in self.over_capacity:
            view["not_applying"] = f"this peer runs {self.config.max_jobs} other live jobs (max_jobs)"
        return view

    def _online_with_me(self) -> set[str]:
        return {*self.online(), self.me}

    async def find(self, job_id: Any) -> JobEntry:
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_id", "give the job id (or a unique prefix of it)")
        full = resolve_job_id(job_id, self.jobs)
        if full is None:
            with contextlib.suppress(PeerdError):
                await self.discover()
            full = resolve_job_id(job_id, self.jobs)
        if full is None:
            raise ConfigError("job_id", f"no job {job_id!r} is known in swarm {self.swarm!r}")
        return self.jobs[full]

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before the round: a wake set during it (a commit) runs the next at once
                try:
                    reads = await Prefetched.fetch(self.store, self._round_keys())
                    await self.discover(reads)
                    await self.tend(reads)
                except PeerdError as exc:
                    logger.info("job discovery failed: %s", exc)
                except Exception:
                    # A bug (or bytes no check caught) must not end the loop: its finally stops every
                    # runner of every job, and a restarted loop would meet the same input again.
                    logger.exception("jobs round failed; the runners keep running, the next round retries")
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await within(self._wake.wait(), self.config.discover_s)
        finally:
            await self.close()

    async def close(self) -> None:
        for entry in self.jobs.values():
            await self._stop(entry)

    def _round_keys(self) -> list[str]:
        """What a round of the loop reads: the job index, the record of every job not known to be
        finished, and the progress of every committed job still reporting (one DHT traversal)."""
        keys = [jobs_key(self.swarm)]
        for job_id, entry in self.jobs.items():
            if entry.record.state not in TERMINAL:
                keys.append(job_key(job_id))
            if entry.commit is not None and not entry.final_progress:
                keys.append(progress_key(job_id))
        return keys

    async def discover(self, store: RecordStore | None = None) -> None:
        """Read the job indexes and the records of every job not known to be finished.

        Serialized: the loop and control calls (``jobs``, an unknown id) both discover, and
        two interleaved discoveries must never create two entries (two planners) for one job.
        ``store``: where to read (the loop passes its round's prefetched reads).
        """
        async with self._discovering:
            await self._discover(store or self.store)

    async def _discover(self, store: RecordStore) -> None:
        ids: set[str] = set()
        for index in await catalog.read_indexes(store, self.swarm, self.rejected):
            ids.update(index.job_ids)
            if index.owner == self.me:  # after a restart: keep listing the jobs this peer owns
                self.my_jobs = list(dict.fromkeys([*index.job_ids, *self.my_jobs]))
        for job_id in sorted(ids | set(self.jobs)):
            try:
                await self._discover_job(job_id, store)
            except PeerdError:
                raise
            except Exception:  # one job's bad input must not hide the others
                logger.exception("job %s: skipped in this round", job_id)

    async def _discover_job(self, job_id: str, store: RecordStore) -> None:
        entry = self.jobs.get(job_id)
        if entry is not None and entry.record.state in TERMINAL:
            return  # final: nothing changes any more
        record = await catalog.read_job(store, job_id, self.rejected)
        if record is None:
            return
        entry = self.jobs.get(job_id)  # submit() may have added it meanwhile
        if entry is None:
            if job_id in self.unusable:
                return
            try:
                spec = record.job_spec()
            except ConfigError as exc:
                self.unusable.add(job_id)
                logger.warning("job %s has a spec this peer cannot use: %s", job_id, exc)
                return
            self.jobs[job_id] = JobEntry(record, spec)
            logger.info("discovered job %s (%s) owned by %s", job_id, spec.name or "unnamed", record.owner)
        elif record.seq > entry.record.seq:
            entry.record = record

    async def tend(self, store: RecordStore | None = None) -> None:
        """Start, feed and stop planners and runners; the owner's duties for its own jobs.

        ``store``: where to read the jobs' progress (the loop passes its round's prefetched reads).
        """
        reads = store or self.store
        now = self.store.now()
        # oldest first: with max_jobs, the jobs this peer applies to are the oldest it sees
        for entry in sorted(self.jobs.values(), key=lambda e: e.record.created_at):
            rec = entry.record
            if rec.state in TERMINAL:
                # a finished job's checkpoints stay served here: peerd fetch gathers them over p2p
                await self._stop(entry, keep_serving=rec.state == JobState.DONE)
                self._forget_health(rec.job_id)
            elif entry.planner_task is None:
                self._start_planner(entry)
            if entry.commit is None and rec.state in TERMINAL and not entry.records_read:
                # a job that ended before this daemon knew it: its allocation from the public records
                with contextlib.suppress(PeerdError):
                    entry.commit = await catalog.read_commit(self.store, rec.job_id)
                    entry.records_read = True
            if entry.commit is not None and not entry.final_progress:
                with contextlib.suppress(PeerdError):
                    read = await catalog.read_progress(reads, rec.job_id)
                    if rec.state in TERMINAL:  # read until every tasklet's last record is in
                        entry.progress = merge_final_records(entry.progress, read)
                        entry.final_reads += 1
                        entry.final_progress = (
                            records_complete(
                                entry.progress, entry.commit.epoch, entry.commit.allocation, rec.state
                            )
                            or entry.final_reads >= FINAL_READS
                        )
                    else:
                        entry.progress = read
                    remember_curve(entry)
                if rec.state not in TERMINAL:
                    await self._check_health(entry, now)
            if rec.owner == self.me:
                await self._owner_duties(entry, now)
        if self.over_capacity:
            self._reoffer()
        if self.my_jobs and now - self._index_stored_at > self.config.refresh_s:
            await self._store_index()

    def _start_planner(self, entry: JobEntry) -> None:
        rec = entry.record
        participate = self._applies(entry)

        def on_commit(commit: Commit) -> None:
            self._on_commit(entry, commit)

        # short protocol windows (peers on one clock) need polls to match: a few per window
        poll = min(self.config.planner.poll_s, max(0.25, min(rec.timing.vote_s, rec.timing.exchange_s) / 4))
        entry.planner = JobPlanner(
            rec,
            entry.spec,
            self.store,
            self.local,
            participate=participate,
            config=replace(self.config.planner, poll_s=poll),
            on_commit=on_commit,
        )
        entry.planner_task = asyncio.create_task(self._supervised(entry.planner.run, f"planner {rec.job_id}"))

    def _on_commit(self, entry: JobEntry, commit: Commit) -> None:
        entry.commit = commit
        self._wake.set()
        job_id = entry.record.job_id
        previous = self._adopting.get(job_id)
        if previous is not None and not previous.done():
            previous.cancel()  # a newer commit supersedes one still being adopted
        self._adopting[job_id] = asyncio.create_task(
            self._supervised(
                lambda: self._adopt(entry, commit), f"adopting job {job_id} epoch {commit.epoch}"
            )
        )

    async def _adopt(self, entry: JobEntry, commit: Commit) -> None:
        """Hand ``commit`` to this peer's runner (creating it when this peer has a tasklet)."""
        job_id = entry.record.job_id
        if self.runner_factory is None or self.leaving or self.paused is not None:
            return
        if entry.runner is None:
            if self.me not in (*commit.allocation.devices, *commit.allocation.spares):
                return  # not allocated: nothing to run, keep or serve
            try:
                entry.runner = self.runner_factory(entry.record, entry.spec)
                await entry.runner.start()
            except PeerdError as exc:
                logger.error("job %s: cannot start this peer's tasklet: %s", job_id, exc)
                entry.runner = None
                return
        roster = None
        for _ in range(30):  # the committed roster's entries propagate within seconds
            assert entry.planner is not None
            roster = await entry.planner.committed_roster(commit)
            if roster is not None:
                break
            await asyncio.sleep(self.config.roster_retry_s)
        if roster is None:
            logger.warning(
                "job %s: the roster of epoch %d is not readable; resuming blind", job_id, commit.epoch
            )
        await entry.runner.adopt(commit, roster, history=sorted(entry.curve.items()))

    async def _check_health(self, entry: JobEntry, now: float) -> None:
        """Re-plan when the job's records say a tasklet's peer is gone or the pipeline is stuck."""
        planner, commit, job_id = entry.planner, entry.commit, entry.record.job_id
        if planner is None or commit is None or planner.replanning or self.leaving or self.paused:
            return
        since = self._recovering_since.setdefault(job_id, {})
        current = {
            (p.epoch, peer): since.get((p.epoch, peer), now)
            for peer, p in entry.progress.items()
            if p.epoch == commit.epoch and p.state == TaskState.RECOVERING
        }
        self._recovering_since[job_id] = current
        verdict = assess(
            commit.allocation,
            commit.epoch,
            entry.progress,
            now,
            committed_at=planner.committed_at if planner.committed_at is not None else now,
            recovering_since={peer: t for (_, peer), t in current.items()},
            config=self.config.health,
            online=self._online_with_me(),
        )
        watch = self._stalls.get(job_id)
        if watch is None or watch.epoch != commit.epoch:
            watch = self._stalls[job_id] = StallWatch(commit.epoch)
        watch.observe(entry.progress, now)
        cause = (
            verdict.cause()
            if verdict.replan
            else watch.stalled(now, self.config.health)
            or self._growth(
                entry, commit.allocation, now, epoch=commit.epoch, roster={p for p, _ in commit.record.roster}
            )
            or following(commit.allocation, self.me, planner.others_replanning())
        )
        if not cause:
            return
        held: tuple[HeldState, ...] = ()
        if entry.runner is not None:
            await entry.runner.freeze(cause)
            held = entry.runner.held()
        # who may apply is decided anew: the peers online when this planner started (dead ones
        # not yet expired among them) may have ranked this peer out of max_peers
        planner.participate = self._applies(entry)
        await planner.replan(cause, held)

    def _applies(self, entry: JobEntry) -> bool:
        """Whether this peer applies for live ``entry``'s next roster: not paused or leaving, not after running
        out of memory on it, ranked within its ``max_peers``, and running fewer than ``max_jobs`` other
        live jobs (otherwise noted in ``over_capacity``, offered again as others end). Jobs that commit
        onto this peer at about the same time can still take it past ``max_jobs``: the check is made
        when it applies, not when it is allocated."""
        job_id = entry.record.job_id
        if self.paused or self.leaving or entry.record.state in TERMINAL:
            return False
        if entry.runner is not None and entry.runner.unfit:
            return False
        if not eligible(job_id, self.me, self.online(), entry.spec.max_peers):
            return False
        busy = self._jobs_running_here(besides=entry)
        if self.config.max_jobs is not None and busy >= self.config.max_jobs:
            if job_id not in self.over_capacity:
                logger.info(
                    "job %s: not applying: this peer runs %d other live jobs (max_jobs %d)",
                    job_id,
                    busy,
                    self.config.max_jobs,
                )
            self.over_capacity.add(job_id)
            return False
        self.over_capacity.discard(job_id)
        return True

    @property
    def holds_work(self) -> bool:
        """Whether this peer holds a runner of a live job (its links carry that job's traffic)."""
        return self._jobs_running_here(besides=None) > 0

    @property
    def engaged(self) -> bool:
        """Whether this peer runs a live job or takes part in planning one (its CPU goes to that,
        besides its upkeep); watching a job it does not apply to is not."""
        return any(
            e.record.state not in TERMINAL
            and (e.runner is not None or (e.planner is not None and e.planner.participate))
            for e in self.jobs.values()
        )

    def _jobs_running_here(self, besides: JobEntry | None) -> int:
        """Live jobs other than ``besides`` that this peer holds a runner of (a tasklet, a role, a spare)."""
        return sum(
            1
            for e in self.jobs.values()
            if e is not besides and e.record.state not in TERMINAL and e.runner is not None
        )

    def _reoffer(self) -> None:
        """Apply to the jobs ``max_jobs`` kept this peer out of, as room frees (they take it at their next epoch)."""
        for job_id in sorted(
            self.over_capacity & self.jobs.keys(), key=lambda j: self.jobs[j].record.created_at
        ):
            entry = self.jobs[job_id]
            if entry.record.state in TERMINAL or entry.planner is None:
                self.over_capacity.discard(job_id)
            elif self._applies(entry):
                entry.planner.participate = True
                logger.info("job %s: applying now that another job ended here", job_id)

    def _forget_health(self, job_id: str) -> None:
        """Drop what health checks kept of a job that ended."""
        self._recovering_since.pop(job_id, None)
        self._stalls.pop(job_id, None)
        self._growth_ledgers.pop(job_id, None)

    def _growth(
        self,
        entry: JobEntry,
        allocation: Allocation,
        now: float,
        *,
        epoch: int = 0,
        roster: set[str] | None = None,
    ) -> str | None:
        """Why a short-handed job should grow back onto the newcomers in sight (``health.short_handed``).

        ``allocation`` is the one committed in ``epoch`` from ``roster`` (the peers that applied).
        """
        online = self.online()
        first = {p: self._online_since.get(p, now) for p in online}
        self._online_since = first  # forget who went offline: a return counts as new
        max_peers = entry.spec.max_peers
        # an rl job runs one trainer: its spares are rollout peers, not room for another replica
        rl = entry.spec.kind == "rl"
        target = 1 if rl else target_width(entry.spec.parallel.d_dp, max_peers, allocation.d_pp)
        job_id = entry.record.job_id
        ledger = self._growth_ledgers.setdefault(job_id, GrowthLedger())
        ledger.observe(online, epoch, roster)
        applying = {
            p: t
            for p, t in first.items()
            if p not in ledger.declined and eligible(job_id, p, online, max_peers)
        }
        cause = short_handed(allocation, target, applying, now, config=self.config.health)
        if cause:
            ledger.ask(epoch, settled_newcomers(allocation, applying, now, config=self.config.health))
        return cause

    # -- volunteer controls ---------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Leave: hand every tasklet over (``left``), keep serving state until the others train without it, or ``grace_s``."""
        self.leaving = True
        await self._hand_over("this peer is leaving the swarm")
        await self._await_handover(grace_s)

    async def pause(self, reason: str = "") -> None:
        """Give the device back: hand the tasklets over and apply for no roster until ``resume``."""
        self.paused = reason or "paused by its volunteer"
        await self._hand_over(f"this peer paused: {self.paused}")

    async def resume(self) -> None:
        """Apply for rosters again: this peer joins a job at its next re-plan (as a spare or to fill a hole)."""
        self.paused = None
        for entry in sorted(self.jobs.values(), key=lambda e: e.record.created_at):
            if entry.planner is not None:
                entry.planner.participate = self._applies(entry)

    async def _hand_over(self, reason: str) -> None:
        for entry in self.jobs.values():
            if entry.planner is not None:
                entry.planner.participate = False
            if entry.runner is not None and entry.record.state not in TERMINAL:
                await entry.runner.leave(reason)

    def _handed_over(self, entry: JobEntry) -> bool:
        """Whether ``entry`` no longer needs this peer: ended, or re-planned without it and running again.

        A commit without this peer is not enough: its successor loads the stage state from this
        peer after the commit, so it is served until every tasklet of the new epoch trains."""
        commit = entry.commit
        if entry.record.state in TERMINAL or commit is None:
            return True
        if tasklet_of(commit.allocation, self.me) is not None:
            return False
        running = (TaskState.RUNNING, TaskState.DONE)
        return all(
            (p := entry.progress.get(peer)) is not None and p.epoch >= commit.epoch and p.state in running
            for peer in commit.allocation.devices
        )

    async def _await_handover(self, grace_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + grace_s
        while asyncio.get_running_loop().time() < deadline:
            if all(self._handed_over(e) for e in self.jobs.values() if e.runner is not None):
                return
            await asyncio.sleep(0.5)
        logger.warning("leaving before every job trains again without this peer (grace %.0f s over)", grace_s)

    async def _supervised(self, run: Callable[[], Awaitable[Any]], what: str) -> Any:
        try:
            return await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s stopped on an unexpected error", what)
            return None

    async def _stop(self, entry: JobEntry, *, keep_serving: bool = False) -> None:
        adopting = self._adopting.pop(entry.record.job_id, None)
        for task in (adopting, entry.planner_task):
            if task is not None and not task.done():
                await cancel_and_wait(task)
        if entry.runner is not None and keep_serving:
            await entry.runner.retire()
        elif entry.runner is not None:
            await entry.runner.close()
            entry.runner = None
        if entry.planner is not None:
            entry.planner.close()

    # -- owner duties ---------------------------------------------------------------------------

    async def _owner_duties(self, entry: JobEntry, now: float) -> None:
        state = effective_state(entry, now)
        rec = entry.record
        if state != rec.state and rec.state not in TERMINAL:
            reason = failure_reason(entry) if state == JobState.FAILED else ""
            entry.record = rec.with_state(state, now, reason)
            logger.info("job %s: %s -> %s", rec.job_id, rec.state.value, state.value)
            await self._store_record(entry)
        elif now - entry.stored_at > self.config.refresh_s:
            entry.record = rec.with_state(rec.state, now, rec.reason)
            await self._store_record(entry)

    async def _put(self, key: str, raw: bytes) -> bool:
        # hivemind replaces a subkey's value only by one that expires later: keep expirations increasing
        expires = max(self.store.now() + self.config.record_ttl_s, self._expiry.get(key, 0.0) + 1e-3)
        self._expiry[key] = expires
        return await self.store.put(key, raw, expires)

    async def _store_tries(self, entry: JobEntry, *, index: bool = False) -> bool:
        """Store ``entry``'s record (``index``: and this peer's job index) in up to SUBMIT_TRIES tries:
        a DHT that has just started, or a loaded machine, may refuse one store."""
        for attempt in range(SUBMIT_TRIES):
            if await self._store_record(entry) and (not index or await self._store_index()):
                return True
            if attempt + 1 < SUBMIT_TRIES:
                logger.info("job %s: storing its records failed, trying again", entry.record.job_id)
                await asyncio.sleep(SUBMIT_RETRY_S * (attempt + 1))
        return False

    async def _store_record(self, entry: JobEntry) -> bool:
        now = self.store.now()
        ok = await self._put(job_key(entry.record.job_id), encode_job(entry.record))
        if ok:
            entry.stored_at = now
        return ok

    async def _store_index(self) -> bool:
        now = self.store.now()
        ids = tuple(self.my_jobs[-64:])
        ok = await self._put(jobs_key(self.swarm), encode_index(JobIndex(self.me, ids, now)))
        if ok:
            self._index_stored_at = now
        return ok
