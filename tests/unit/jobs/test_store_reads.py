"""Batched reads: ``Prefetched`` serves one round's reads from one lookup; the jobs loop asks once per round."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from peerd.errors import ErrorCode, PeerdError
from peerd.jobs.manager import JobManager, ManagerConfig
from peerd.jobs.spec import load_job_spec
from peerd.jobs.store import MemoryDHT, Prefetched
from peerd.loading import to_mapping
from peerd.sched.consensus.messages import RosterDevice
from peerd.swarm.keys import job_key, jobs_key, progress_key
from peerd.swarm.node import dht_get_many_latest

T0 = 2_000_000.0
ME, OTHER = "QmReader" + "r" * 22, "QmWriter" + "w" * 22


class CountingStore:
    """A ``MemoryStore`` that logs every read and lookup it is asked for."""

    def __init__(self, inner) -> None:
        self.inner, self.me = inner, inner.me
        self.reads: list[str] = []
        self.lookups: list[list[str]] = []

    def now(self) -> float:
        return self.inner.now()

    async def put(self, key, value, expires_at):
        return await self.inner.put(key, value, expires_at)

    async def read(self, key):
        self.reads.append(key)
        return await self.inner.read(key)

    async def read_many(self, keys):
        self.lookups.append(list(keys))
        return await self.inner.read_many(keys)


def test_prefetched_answers_its_keys_and_passes_the_rest() -> None:
    async def scenario() -> None:
        dht = MemoryDHT(lambda: T0)
        writer, reader = dht.client(OTHER), CountingStore(dht.client(ME))
        for key in ("k/a", "k/b", "k/c"):
            assert await writer.put(key, key.encode(), T0 + 60)
        view = await Prefetched.fetch(reader, ["k/a", "k/b", "k/none"])
        assert reader.lookups == [["k/a", "k/b", "k/none"]] and reader.reads == []
        assert [e.value for e in await view.read("k/a")] == [b"k/a"]
        assert await view.read("k/none") == []  # fetched: found nothing, asks nobody again
        assert reader.reads == []
        assert [e.value for e in await view.read("k/c")] == [b"k/c"]  # not fetched: read through
        assert reader.reads == ["k/c"]
        both = await view.read_many(["k/b", "k/c"])
        assert reader.lookups[-1] == ["k/c"] and [e.value for e in both["k/b"]] == [b"k/b"]
        assert await view.put("k/d", b"mine", T0 + 60)  # writes go to the store
        assert [e.author for e in await reader.read("k/d")] == [ME]
        assert view.me == ME and view.now() == T0

    asyncio.run(scenario())


def test_a_jobs_round_reads_index_records_and_progress_in_one_lookup() -> None:
    spec = to_mapping(load_job_spec("configs/jobs/gpt-tiny-demo.yaml"))

    async def scenario() -> None:
        dht = MemoryDHT(lambda: T0)
        store = CountingStore(dht.client(ME))
        manager = JobManager(
            store,
            "default",
            local=lambda: (RosterDevice(0.1, 1 << 33, "eu"), ()),
            online=lambda: [ME],
            config=ManagerConfig(discover_s=0.01),
        )
        job = (await manager.submit({"spec": spec}))["job_id"]
        manager.jobs[job].commit = object()  # committed: its progress is read each round too
        store.reads.clear()
        store.lookups.clear()
        loop = asyncio.ensure_future(manager.run())
        try:
            for _ in range(200):
                await asyncio.sleep(0.01)
                if len([k for k in store.lookups if jobs_key("default") in k]) >= 3:
                    break
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        rounds = [k for k in store.lookups if jobs_key("default") in k]
        assert len(rounds) >= 3
        assert all(k == [jobs_key("default"), job_key(job), progress_key(job)] for k in rounds)
        mine = {jobs_key("default"), job_key(job), progress_key(job)}
        assert not mine & set(store.reads), f"a round read its keys one by one: {store.reads}"

    asyncio.run(scenario())


def test_a_silent_dht_fails_the_whole_lookup_with_a_timeout() -> None:
    class SilentDHT:
        def run_coroutine(self, coro, return_future=False):
            return asyncio.get_running_loop().create_future()  # never answered

    async def scenario() -> None:
        with pytest.raises(PeerdError) as err:
            await dht_get_many_latest(SilentDHT(), ["a", "b"], timeout=0.05, what="2 keys")
        assert err.value.code == ErrorCode.TIMEOUT and "2 keys" in str(err.value)
        assert await dht_get_many_latest(SilentDHT(), [], timeout=0.05, what="nothing") == {}

    asyncio.run(scenario())
