"""One daemon's jobs kept in step with the swarm's records: discovery, a planner and a tasklet per job, owner duties.

``JobManager.run()`` loops every ``discover_s``: read the owners' job indexes of this swarm,
the job records they name (only the owner's own record counts, see ``catalog``), and for
every live job keep one ``JobPlanner`` (participating when this peer is eligible) and, once
an allocation that includes this peer is committed, one ``TaskletRunner``. A job's state as
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
from peerd.jobs.runner import TaskletRunner, tasklet_of, unsupported
from peerd.jobs.scoring import job_model
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.jobs.store import RecordStore
from peerd.jobs.views import JobEntry, effective_state, job_view, resolve_job_id
from peerd.log import get_logger
from peerd.sched.consensus.actions import Commit
from peerd.swarm.keys import job_key, jobs_key

logger = get_logger(__name__)

RunnerFactory = Callable[[JobRecord, JobSpec, Commit], TaskletRunner]


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
        if not await self._store_record(entry) or not await self._store_index():
            raise PeerdError(
                "no DHT node accepted the job record; is this peer connected?",
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
        }

    async def cancel(self, params: dict[str, Any]) -> dict[str, Any]:
        """Cancel a job this peer owns; NOT_OWNER for anybody else's."""
        entry = await self._find(params.get("job_id"))
        rec = entry.record
        if rec.owner != self.me:
            raise ProtocolError(
                f"job {rec.job_id} belongs to {rec.owner}; only its owner may cancel it (this peer is {self.me})",
                code=ErrorCode.NOT_OWNER,
            )
        if rec.state in TERMINAL:
            return {"job_id": rec.job_id, "state": rec.state.value, "changed": False}
        entry.record = rec.with_state(JobState.CANCELLED, self.store.now(), str(params.get("reason") or ""))
        if not await self._store_record(entry):
            raise PeerdError(
                "no DHT node accepted the cancel record; try again", code=ErrorCode.PEER_UNAVAILABLE
            )
        await self._stop(entry)
        logger.info("cancelled job %s", rec.job_id)
        return {"job_id": rec.job_id, "state": JobState.CANCELLED.value, "changed": True}

    async def list_jobs(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        if params.get("refresh", True):
            with contextlib.suppress(PeerdError):
                await self.discover()
        return self.views(detail=False)

    async def job_status(self, params: dict[str, Any]) -> dict[str, Any]:
        entry = await self._find(params.get("job_id"))
        return job_view(entry, self.me, self.store.now(), detail=True)

    def views(self, detail: bool = True) -> list[dict[str, Any]]:
        now = self.store.now()
        entries = sorted(self.jobs.values(), key=lambda e: e.record.created_at, reverse=True)
        return [job_view(e, self.me, now, detail=detail) for e in entries]

    async def _find(self, job_id: Any) -> JobEntry:
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
                try:
                    await self.discover()
                    await self.tend()
                except PeerdError as exc:
                    logger.info("job discovery failed: %s", exc)
                except Exception:
                    # A bug (or bytes no check caught) must not end the loop: its finally stops every
                    # runner of every job, and a restarted loop would meet the same input again.
                    logger.exception("jobs round failed; the runners keep running, the next round retries")
                self._wake.clear()
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.config.discover_s)
        finally:
            await self.close()

    async def close(self) -> None:
        for entry in self.jobs.values():
            await self._stop(entry)

    async def discover(self) -> None:
        """Read the job indexes and the records of every job not known to be finished.

        Serialized: the loop and control calls (``jobs``, an unknown id) both discover, and
        two interleaved discoveries must never create two entries (two planners) for one job.
        """
        async with self._discovering:
            await self._discover()

    async def _discover(self) -> None:
        ids: set[str] = set()
        for index in await catalog.read_indexes(self.store, self.swarm, self.rejected):
            ids.update(index.job_ids)
            if index.owner == self.me:  # after a restart: keep listing the jobs this peer owns
                self.my_jobs = list(dict.fromkeys([*index.job_ids, *self.my_jobs]))
        for job_id in sorted(ids | set(self.jobs)):
            try:
                await self._discover_job(job_id)
            except PeerdError:
                raise
            except Exception:  # one job's bad input must not hide the others
                logger.exception("job %s: skipped in this round", job_id)

    async def _discover_job(self, job_id: str) -> None:
        entry = self.jobs.get(job_id)
        if entry is not None and entry.record.state in TERMINAL:
            return  # final: nothing changes any more
        record = await catalog.read_job(self.store, job_id, self.rejected)
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

    async def tend(self) -> None:
        """Start, feed and stop planners and runners; the owner's duties for its own jobs."""
        now = self.store.now()
        for entry in list(self.jobs.values()):
            rec = entry.record
            if rec.state in TERMINAL:
                await self._stop(entry)
            elif entry.planner_task is None:
                self._start_planner(entry)
            if entry.commit is not None and not entry.final_progress:
                with contextlib.suppress(PeerdError):
                    entry.progress = await catalog.read_progress(self.store, rec.job_id)
                    entry.final_progress = rec.state in TERMINAL  # one last read after the end
            if rec.owner == self.me:
                await self._owner_duties(entry, now)
        if self.my_jobs and now - self._index_stored_at > self.config.refresh_s:
            await self._store_index()

    def _start_planner(self, entry: JobEntry) -> None:
        rec = entry.record
        online = self.online()
        participate = eligible(rec.job_id, self.me, online, entry.spec.max_peers)

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
        old = entry.commit
        entry.commit = commit
        self._wake.set()
        if old is not None and old.allocation_hash == commit.allocation_hash:
            return
        if entry.runner_task is not None:
            logger.warning(
                "job %s: a newer allocation superseded the running one; restarting the tasklet",
                entry.record.job_id,
            )
            entry.runner_task.cancel()
            entry.runner, entry.runner_task = None, None
        if self.runner_factory is None or tasklet_of(commit.allocation, self.me) is None:
            return
        try:
            entry.runner = self.runner_factory(entry.record, entry.spec, commit)
        except PeerdError as exc:
            logger.error("job %s: cannot start this peer's tasklet: %s", entry.record.job_id, exc)
            return
        entry.runner_task = asyncio.create_task(
            self._supervised(entry.runner.run, f"tasklet {entry.record.job_id}")
        )

    async def _supervised(self, run: Callable[[], Awaitable[Any]], what: str) -> Any:
        try:
            return await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s stopped on an unexpected error", what)
            return None

    async def _stop(self, entry: JobEntry) -> None:
        for name in ("runner_task", "planner_task"):
            task = getattr(entry, name)
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if entry.planner is not None:
            entry.planner.close()

    # -- owner duties ---------------------------------------------------------------------------

    async def _owner_duties(self, entry: JobEntry, now: float) -> None:
        state = effective_state(entry, now)
        rec = entry.record
        if state != rec.state and rec.state not in TERMINAL:
            reason = ""
            if state == JobState.FAILED:
                failed = [p for p in entry.progress.values() if p.state == TaskState.FAILED]
                reason = failed[0].reason if failed else ""
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
