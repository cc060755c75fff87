"""The job manager offline: submit validation, discovery, owner-only cancel, forged cancels, states, eligibility."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from peerd.errors import ErrorCode, PeerdError, ProtocolError
from peerd.jobs import manager as manager_module
from peerd.jobs.manager import JobManager, ManagerConfig, eligible
from peerd.jobs.records import JobState, TaskState, encode_job, new_job_record
from peerd.jobs.spec import JobSpecError, ParallelSpec, load_job_spec, parse_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.jobs.views import JobEntry
from peerd.loading import load_mapping, to_mapping
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import RosterDevice
from peerd.swarm.keys import job_key

T0 = 2_000_000.0
OWNER, OTHER, THIRD = ("QmSubmitter" + "x" * 20, "QmStranger" + "y" * 20, "QmWatcher" + "z" * 20)
DEMO = load_job_spec("configs/jobs/gpt-tiny-demo.yaml")


class Managers:
    def __init__(self, peers: list[str], config: ManagerConfig | None = None) -> None:
        self.clock = [T0]
        self.dht = MemoryDHT(lambda: self.clock[0])
        self.by_peer = {
            p: JobManager(
                self.dht.client(p),
                "default",
                local=lambda: (RosterDevice(0.1, 1 << 33, "eu"), ()),
                online=lambda: list(peers),
                config=config,
            )
            for p in peers
        }

    async def sync(self) -> None:
        for m in self.by_peer.values():
            await m.discover()
            await m.tend()

    async def close(self) -> None:
        for m in self.by_peer.values():
            await m.close()


def test_submit_refuses_a_bad_spec_naming_every_field() -> None:
    async def scenario() -> None:
        ms = Managers([OWNER])
        raw = load_mapping("tests/unit/jobs/invalid-spec.yaml")
        with pytest.raises(JobSpecError) as err:
            await ms.by_peer[OWNER].submit({"spec": raw})
        fields = {e.field for e in err.value.errors}
        assert len(fields) >= 3  # every bad field is named, not just the first
        for f in fields:
            assert f in str(err.value)
        assert ms.dht.puts == 0  # nothing was published

    asyncio.run(scenario())


def test_discovery_owner_only_cancel_and_forged_cancels() -> None:
    async def scenario() -> None:
        ms = Managers([OWNER, OTHER, THIRD])
        try:
            out = await ms.by_peer[OWNER].submit({"spec": to_mapping(DEMO)})
            job = out["job_id"]
            await ms.sync()
            for m in ms.by_peer.values():
                assert job in m.jobs, "every daemon discovers the job through the owner's index"
                assert m.views()[0]["state"] == "pending"
            # a non-owner's cancel is refused at the control method
            with pytest.raises(ProtocolError) as err:
                await ms.by_peer[OTHER].cancel({"job_id": job[:8]})
            assert err.value.code == ErrorCode.NOT_OWNER
            # ... and one stored directly in the DHT under the non-owner's subkey is ignored by everyone
            record = ms.by_peer[OTHER].jobs[job].record
            forged = record.with_state(JobState.CANCELLED, T0 + 1, "forged")
            await ms.dht.client(OTHER).put(job_key(job), encode_job(forged), T0 + 10**6)
            ms.clock[0] = record.epoch0_start + 0.5
            await ms.sync()
            for m in ms.by_peer.values():
                view = m.views()[0]
                assert view["state"] == "planning" and view["record_state"] != "cancelled"
                assert m.jobs[job].planner_task is not None
            assert ms.by_peer[THIRD].rejected.not_owner >= 1
            # the owner's cancel counts everywhere and stops planning
            result = await ms.by_peer[OWNER].cancel({"job_id": job, "reason": "test"})
            assert result == {"job_id": job, "state": "cancelled", "changed": True}
            await ms.sync()
            for m in ms.by_peer.values():
                entry = m.jobs[job]
                assert m.views()[0]["state"] == "cancelled" and entry.record.reason == "test"
                assert entry.planner_task is not None and entry.planner_task.done()
            # listing and unknown ids
            listed = await ms.by_peer[THIRD].list_jobs({})
            assert [v["job_id"] for v in listed] == [job] and listed[0]["owner"] == OWNER
            with pytest.raises(Exception) as missing:
                await ms.by_peer[THIRD].job_status({"job_id": "ffffffff"})
            assert "no job" in str(missing.value)
        finally:
            await ms.close()

    asyncio.run(scenario())


def test_submit_tries_the_store_again_before_failing(monkeypatch) -> None:
    """A DHT that has just started may refuse a store: submit tries three times, then fails naming it."""
    monkeypatch.setattr(manager_module, "SUBMIT_RETRY_S", 0.01)

    async def scenario() -> None:
        ms = Managers([OWNER])
        store = ms.by_peer[OWNER].store
        accept = store.put
        refusals = [1]

        async def flaky(key, value, expires_at):
            if refusals[0] > 0:
                refusals[0] -= 1
                return False
            return await accept(key, value, expires_at)

        store.put = flaky
        try:
            out = await ms.by_peer[OWNER].submit({"spec": to_mapping(DEMO)})
            await ms.sync()
            assert out["job_id"] in ms.by_peer[OWNER].jobs and ms.dht.puts >= 2  # record and index stored
            store.offline = True
            with pytest.raises(PeerdError) as err:
                await ms.by_peer[OWNER].submit({"spec": to_mapping(DEMO)})
            assert err.value.code == ErrorCode.PEER_UNAVAILABLE and "3 tries" in str(err.value)
        finally:
            await ms.close()

    asyncio.run(scenario())


def test_cancel_tries_the_store_again_and_a_refused_cancel_still_reaches_the_peers(monkeypatch) -> None:
    """CI saw `peerd cancel` fail on one refused store under load ("try again"), and a second cancel
    then answered "not changed" without storing anything. The cancel now tries three times like a
    submit; when every try fails it says so, and the record, cancelled here, still reaches the other
    peers with the owner's next re-store."""
    monkeypatch.setattr(manager_module, "SUBMIT_RETRY_S", 0.01)

    async def scenario() -> None:
        ms = Managers([OWNER, OTHER])
        owner = ms.by_peer[OWNER]
        store, accept, refusals = owner.store, owner.store.put, [1]

        async def flaky(key, value, expires_at):
            if refusals[0] > 0:
                refusals[0] -= 1
                return False
            return await accept(key, value, expires_at)

        try:
            first = (await owner.submit({"spec": to_mapping(DEMO)}))["job_id"]
            second = (await owner.submit({"spec": to_mapping(DEMO)}))["job_id"]
            await ms.sync()
            store.put = flaky
            assert (await owner.cancel({"job_id": first}))["changed"] is True
            store.offline = True
            with pytest.raises(PeerdError) as err:
                await owner.cancel({"job_id": second})
            assert err.value.code == ErrorCode.PEER_UNAVAILABLE and "3 tries" in str(err.value)
            store.offline = False
            ms.clock[0] += owner.config.refresh_s + 1  # the owner's next re-store
            await ms.sync()
            await ms.sync()
            seen = {v["job_id"]: v["state"] for v in ms.by_peer[OTHER].views()}
            assert seen == {first: "cancelled", second: "cancelled"}
        finally:
            await ms.close()

    asyncio.run(scenario())


def test_eligibility_caps_the_roster_deterministically() -> None:
    peers = [f"Qm{i:030d}" for i in range(10)]
    chosen = [p for p in peers if eligible("job", p, peers, 6)]
    assert len(chosen) == 6
    assert all(eligible("job", p, peers, None) for p in peers)
    assert all(eligible("job", p, peers, 10) for p in peers)
    assert [p for p in peers if eligible("job2", p, peers, 6)] != chosen  # per job, not always the same peers


class _Holding:
    """Stands for a runner this peer holds (the daemons' own runners: tests/integration/test_jobs.py)."""

    unfit = None
    stage = replica = step = 0
    state = TaskState.RUNNING
    recoveries = ()

    async def close(self) -> None:
        pass

    async def leave(self, reason: str) -> None:
        pass

    def phases(self) -> dict[str, float]:
        return {}

    def s_per_step(self) -> float | None:
        return None


def test_max_jobs_counts_the_jobs_a_peer_runs_not_those_it_plans() -> None:
    """A stranger's many jobs cannot make a peer load a model for each: running max_jobs, it applies to no
    other; planning holds nothing, so jobs that never commit cannot lock it out of the others."""

    async def scenario() -> None:
        ms = Managers([OWNER, OTHER], ManagerConfig(max_jobs=2))
        watcher = ms.by_peer[OTHER]
        try:
            jobs = []
            for i in range(3):
                ms.clock[0] = T0 + i
                spec = dataclasses.replace(DEMO, name=f"job{i}")
                jobs.append((await ms.by_peer[OWNER].submit({"spec": to_mapping(spec)}))["job_id"])
            await ms.sync()
            assert all(watcher.jobs[j].planner.participate for j in jobs)  # three jobs planning: no limit
            assert not watcher.holds_work  # planning holds nothing (the daemon still re-probes its links)
            assert watcher.engaged  # but its CPU plans: no idle load is measured meanwhile
            for j in jobs[:2]:  # two of them committed onto this peer
                watcher.jobs[j].runner = _Holding()
            assert watcher.holds_work
            ms.clock[0] = T0 + 3
            late = await ms.by_peer[OWNER].submit(
                {"spec": to_mapping(dataclasses.replace(DEMO, name="late"))}
            )
            await ms.sync()
            assert not watcher.jobs[late["job_id"]].planner.participate
            assert watcher.over_capacity == {late["job_id"]}
            view = {v["job_id"]: v for v in watcher.views()}
            assert "max_jobs" in view[late["job_id"]]["not_applying"]
            assert "not_applying" not in view[jobs[2]]
            # a running job ends: the peer applies again (at the job's next epoch)
            await ms.by_peer[OWNER].cancel({"job_id": jobs[0]})
            await ms.sync()
            assert watcher.jobs[late["job_id"]].planner.participate and not watcher.over_capacity
            # a paused peer applies to none; on resume it applies within the limit again
            await watcher.pause("test")
            assert not any(e.planner.participate for e in watcher.jobs.values())
            await watcher.resume()
            live = [j for j in (*jobs[1:], late["job_id"]) if watcher.jobs[j].planner.participate]
            assert live == [*jobs[1:], late["job_id"]]
        finally:
            await ms.close()

    asyncio.run(scenario())


def test_concurrent_discoveries_start_one_planner_per_job() -> None:
    """The loop and control calls both discover; interleaved reads must not duplicate a job's planner."""

    class SlowStore:
        """The first read of a job record (a slow DHT lookup) is held until the test releases it."""

        def __init__(self, inner) -> None:
            self.inner, self.me, self.slow = inner, inner.me, True
            self.reading, self.release = asyncio.Event(), asyncio.Event()

        def now(self) -> float:
            return self.inner.now()

        async def put(self, key, value, expires_at):
            return await self.inner.put(key, value, expires_at)

        async def read(self, key):
            if key.startswith("peerd/v1/job/") and self.slow:
                self.slow = False
                self.reading.set()
                await self.release.wait()
            return await self.inner.read(key)

        async def read_many(self, keys):
            return {key: await self.read(key) for key in keys}

    class WatchedLock(asyncio.Lock):
        """The manager's discovery lock, telling when a second discovery has to wait its turn."""

        def __init__(self) -> None:
            super().__init__()
            self.contended = asyncio.Event()

        async def acquire(self) -> bool:
            if self.locked():
                self.contended.set()
            return await super().acquire()

    async def scenario() -> None:
        ms = Managers([OWNER])
        store = SlowStore(ms.dht.client(THIRD))
        watcher = JobManager(
            store,
            "default",
            local=lambda: (RosterDevice(0.1, 1 << 33, "eu"), ()),
            online=lambda: [OWNER, THIRD],
        )
        lock = watcher._discovering = WatchedLock()
        started = []
        original = watcher._start_planner
        watcher._start_planner = lambda entry: (started.append(entry.record.job_id), original(entry))[1]
        try:
            job = (await ms.by_peer[OWNER].submit({"spec": to_mapping(DEMO)}))["job_id"]

            async def loop_round() -> None:
                await watcher.discover()
                await watcher.tend()

            async def interleave() -> None:
                await store.reading.wait()  # the control call's discovery is inside its slow read
                round_ = asyncio.create_task(loop_round())
                contended = asyncio.create_task(lock.contended.wait())
                # the loop's discovery either ran through meanwhile or waits for the control call's
                await asyncio.wait({round_, contended}, return_when=asyncio.FIRST_COMPLETED)
                contended.cancel()
                store.release.set()
                await round_

            await asyncio.gather(watcher.job_status({"job_id": job}), interleave())
            await watcher.tend()
            assert started == [job]
            assert watcher.jobs[job].planner_task is not None
        finally:
            await watcher.close()
            await ms.close()

    asyncio.run(scenario())


def test_submit_takes_finetune_and_runs_the_whole_optimizer(tmp_path) -> None:
    async def scenario() -> None:
        ms = Managers([OWNER])
        try:
            # init_checkpoint is read by each tasklet on its own disk (tests/integration/test_hf_jobs.py),
            # not by the submitter, which may not hold it
            finetune = {
                **to_mapping(DEMO),
                "kind": "finetune",
                "init_checkpoint": str(tmp_path / "elsewhere"),
            }
            assert (await ms.by_peer[OWNER].submit({"spec": finetune}))["job_id"]
            out = await ms.by_peer[OWNER].submit({"spec": to_mapping(DEMO)})
            # the demo's cosine schedule, warm-up, betas and clipping all run: nothing is "ignored"
            assert not any("ignored" in w for w in out["warnings"])
        finally:
            await ms.close()

    asyncio.run(scenario())


def test_an_rl_job_is_never_short_handed_its_spares_roll_out() -> None:
    """A pretraining job with a settled newcomer grows; an rl job's spares are its rollout peers, not room."""

    async def scenario() -> None:
        ms = Managers([OWNER, OTHER, THIRD, "QmFourth" + "w" * 22])
        manager = ms.by_peer[OWNER]
        manager.config = dataclasses.replace(
            manager.config, health=dataclasses.replace(manager.config.health, grow_settle_s=0.0)
        )
        rl = parse_job_spec(
            {
                "kind": "rl",
                "model": {"preset": "tiny"},
                "steps": 10,
                "global_batch": 16,
                "micro_batch": 16,
                "min_peers": 2,
                "max_peers": 4,
                "rl": {"group_size": 8},
            }
        )
        pretrain = dataclasses.replace(DEMO, min_peers=2, max_peers=4, parallel=ParallelSpec("auto", "auto"))
        alloc = Allocation(((OWNER,),), (OTHER, THIRD))  # one tasklet, two spares, the fourth peer is new
        for spec, grows in ((pretrain, True), (rl, False)):
            entry = JobEntry(
                new_job_record(
                    OWNER, "default", spec, bytes(16), now=T0, epoch0_start=T0, timing=spec.planning.timing()
                ),
                spec,
            )
            cause = manager._growth(entry, alloc, T0 + 100.0)
            assert (cause is not None) == grows, (spec.kind, cause)
        await ms.close()

    asyncio.run(scenario())


def test_a_newcomer_whose_entry_missed_the_growth_roster_gets_one_more_replan() -> None:
    """CI once saw a newcomer's daemon read the job an epoch late: its roster entry went to the epoch
    after the growth re-plan it had triggered, that re-plan committed the old shape without it, and
    it was declined for good, so the job never grew. Only the consensus leaving it out declines it."""

    async def scenario() -> None:
        fourth = "QmFourth" + "w" * 22
        ms = Managers([OWNER, OTHER, THIRD, fourth])
        manager = ms.by_peer[OWNER]
        manager.config = dataclasses.replace(
            manager.config, health=dataclasses.replace(manager.config.health, grow_settle_s=0.0)
        )
        spec = dataclasses.replace(DEMO, min_peers=2, max_peers=4, parallel=ParallelSpec("auto", "auto"))
        alloc = Allocation(((OWNER,),), (OTHER, THIRD))  # one tasklet, two spares, the fourth peer is new
        old = {OWNER, OTHER, THIRD}

        def entry(nonce: bytes) -> JobEntry:
            record = new_job_record(
                OWNER, "default", spec, nonce, now=T0, epoch0_start=T0, timing=spec.planning.timing()
            )
            return JobEntry(record, spec)

        lagging = entry(bytes(16))
        assert manager._growth(lagging, alloc, T0 + 100.0, epoch=1, roster=old)
        assert (
            manager._growth(lagging, alloc, T0 + 101.0, epoch=1, roster=old) is None
        )  # asked once per epoch
        # the re-plan committed epoch 2 from a roster without the newcomer: one more try
        assert manager._growth(lagging, alloc, T0 + 110.0, epoch=2, roster=old)
        assert manager._growth(lagging, alloc, T0 + 120.0, epoch=3, roster=old) is None  # missed twice

        left_out = entry(b"x" * 16)  # it applied, and the consensus kept the old shape: declined
        assert manager._growth(left_out, alloc, T0 + 100.0, epoch=1, roster=old)
        assert manager._growth(left_out, alloc, T0 + 110.0, epoch=2, roster={*old, fourth}) is None
        await ms.close()

    asyncio.run(scenario())


def test_a_leaving_peer_serves_its_state_until_its_successor_trains() -> None:
    """A commit without the leaving peer is not the end of its duty: the successor loads the stage
    state from it after that commit, so the peer waits until every new tasklet trains (it used to
    exit at the commit, and the successor fell back to an older copy: steps lost)."""
    from peerd.jobs.records import Progress, TaskState
    from peerd.sched.consensus.actions import Commit

    async def scenario() -> None:
        ms = Managers([OWNER, OTHER, THIRD])
        manager = ms.by_peer[OTHER]  # the leaving peer
        entry = JobEntry(
            new_job_record(
                OWNER, "default", DEMO, bytes(16), now=T0, epoch0_start=T0, timing=DEMO.planning.timing()
            ),
            DEMO,
        )

        def at(epoch: int, allocation: Allocation) -> Commit:
            return Commit(epoch, 0, allocation, "00" * 32, "00" * 32, 1.0, record=None)  # type: ignore[arg-type]

        def progress(peer: str, epoch: int, state: TaskState) -> Progress:
            return Progress(
                job_id=entry.record.job_id,
                peer=peer,
                epoch=epoch,
                stage=0,
                replica=0,
                step=5,
                steps=100,
                state=state,
                tokens_per_s=1.0,
                updated_at=T0,
                started_at=T0,
            )

        entry.commit = at(1, Allocation(((OWNER,), (OTHER,)), (THIRD,)))
        assert not manager._handed_over(entry)  # still holds a tasklet
        entry.commit = at(2, Allocation(((OWNER,), (THIRD,))))
        entry.progress = {
            OWNER: progress(OWNER, 2, TaskState.RUNNING),
            THIRD: progress(THIRD, 1, TaskState.RUNNING),
        }
        assert not manager._handed_over(entry)  # the successor's record is still the old epoch's
        entry.progress[THIRD] = progress(THIRD, 2, TaskState.RECOVERING)
        assert not manager._handed_over(entry)  # loading (from this peer)
        entry.progress[THIRD] = progress(THIRD, 2, TaskState.RUNNING)
        assert manager._handed_over(entry)
        entry.progress.pop(OWNER)
        assert not manager._handed_over(entry)
        await ms.close()

    asyncio.run(scenario())
