"""State transfer over real p2pd daemons on loopback: whole, resumed after a holder dies, hostile holders, budgets."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from peerd.errors import ErrorCode, PeerdError, ProtocolError
from peerd.pipeline import checkpoint
from peerd.pipeline.replicas import CheckpointReplicas, own_checkpoints, replicate
from peerd.pipeline.statesync import (
    KIND_CHUNK,
    KIND_DESCRIBE,
    REQUEST_KINDS,
    Data,
    Describe,
    Info,
    StateFetchError,
    StateServer,
    StateSyncConfig,
    fetch_state,
    header,
    pack_state,
    parse,
    state_protocol,
    unpack_state,
)
from peerd.swarm.framing import FrameLimits, StreamClosed, frame_head
from peerd.swarm.transport import Connection, RetryPolicy, Transport

pytestmark = pytest.mark.integration

JOB = "0f3a" * 8
STAGE, STEP = 1, 40
CHUNK = 64 * 1024
FAST = StateSyncConfig(chunk_bytes=CHUNK, connect_timeout_s=5, request_timeout_s=5, deadline_s=60)


def make_state(numel: int = 1 << 20) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "format": 1,
        "job": JOB,
        "stage": STAGE,
        "replica": 0,
        "step": STEP,
        "module": {"w": torch.randn(numel, generator=g)},
        "optimizer": {"state": {}, "param_groups": []},
        "data": {"position": 1234},
        "meta": {},
    }


BLOB = pack_state(make_state())  # ~4 MiB


def holding(blob: bytes, stage: int = STAGE, step: int = STEP) -> Callable[[int, int], bytes | None]:
    return lambda s, t: blob if (s, t) == (stage, step) else None


class Swarm:
    """p2pd daemons on one event loop, each with a Transport; ``c`` is the fetching peer."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.p2ps: list[P2P] = []
        self.transports: list[Transport] = []

    def run(self, coro, timeout: float = 60.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def peer(self) -> Transport:
        initial = await self.p2ps[0].get_visible_maddrs() if self.p2ps else []
        p2p = await P2P.create(initial_peers=initial)
        self.p2ps.append(p2p)
        transport = Transport(p2p, retry=RetryPolicy(attempts=2, base_backoff_s=0.05, ban_after_failures=50))
        self.transports.append(transport)
        return transport

    async def kill(self, transport: Transport) -> None:
        """What a SIGKILL does to the holder's side of the streams: its p2pd goes away."""
        await transport.p2p.shutdown()
        await transport.close()

    async def start(self) -> None:
        self.a, self.b, self.c, self.d = [await self.peer() for _ in range(4)]

    async def stop(self) -> None:
        for transport in reversed(self.transports):
            await transport.close()
        for p2p in reversed(self.p2ps):
            await p2p.shutdown()


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    s = Swarm()
    try:
        s.run(s.start())
        yield s
    finally:
        s.run(s.stop(), timeout=30)
        s.loop.close()


class Hostile:
    """A holder that speaks the protocol but lies: ``mode`` says how."""

    def __init__(self, transport: Transport, blob: bytes, mode: str) -> None:
        self.transport, self.blob, self.mode = transport, blob, mode
        self.chunks = 0

    async def handle(self, conn: Connection) -> None:
        while True:
            try:
                raw, _ = await conn.recv(timeout=10)
            except StreamClosed:
                return
            msg = parse(raw, REQUEST_KINDS)
            if msg.kind == KIND_DESCRIBE:
                size = 1 << 40 if self.mode == "huge" else len(self.blob)
                sha = hashlib.sha256(self.blob).digest()
                await conn.send(
                    header(Info(stage=msg.stage, step=msg.step, size=size, sha256=sha, chunk=CHUNK))
                )
                continue
            assert msg.kind == KIND_CHUNK
            self.chunks += 1
            data = Data(stage=msg.stage, step=msg.step, offset=msg.offset, length=msg.length)
            piece = bytearray(self.blob[msg.offset : msg.offset + msg.length])
            if self.mode == "corrupt" and self.chunks == 3:
                piece[7] ^= 0x40
            if self.mode == "flood":  # announce a payload far above the chunk asked for
                await conn._write(memoryview(frame_head(header(data), 1 << 30)))
                await conn._write(memoryview(bytes(CHUNK)))
                continue
            await conn.send(header(data), piece)

    async def __aenter__(self) -> Hostile:
        await self.transport.serve(state_protocol(JOB), self.handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.transport.stop_serving(state_protocol(JOB))


def test_whole_transfer_round_trips_the_state(swarm: Swarm, async_wait_until):
    async def go():
        server = StateServer(swarm.a, JOB, holding(BLOB), config=FAST)
        await server.start()
        try:
            blob = await fetch_state(
                swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST
            )
            # the session ends when the server reads the client's close; then the blob is dropped
            await async_wait_until(lambda: server.sessions == 0, 20, "the session to end")
            return blob, server.bytes_served, server.cached
        finally:
            await server.close()

    blob, served, cached = swarm.run(go())
    assert blob == BLOB and served == len(BLOB)
    assert cached == []
    state = unpack_state(blob)
    torch.testing.assert_close(state["module"]["w"], make_state()["module"]["w"], rtol=0, atol=0)
    assert state["data"] == {"position": 1234}


def test_concurrent_fetches_share_one_pack(swarm: Swarm, async_wait_until):
    gate = threading.Event()

    def provider(stage: int, step: int) -> bytes | None:
        gate.wait(10)  # hold the pack until both sessions wait for it
        return BLOB if (stage, step) == (STAGE, STEP) else None

    async def go():
        server = StateServer(swarm.a, JOB, provider, config=FAST)
        await server.start()
        try:
            fetches = [
                asyncio.create_task(
                    fetch_state(t, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST)
                )
                for t in (swarm.b, swarm.c)
            ]
            await async_wait_until(lambda: server.sessions == 2, 20, "two sessions waiting for the pack")
            gate.set()
            return await asyncio.gather(*fetches), server.packs
        finally:
            await server.close()

    blobs, packs = swarm.run(go())
    assert blobs == [BLOB, BLOB] and packs == 1


def test_unknown_stage_or_step_is_refused_typed(swarm: Swarm):
    async def go():
        server = StateServer(swarm.a, JOB, holding(BLOB), config=FAST)
        await server.start()
        try:
            await fetch_state(
                swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP + 1, max_bytes=8 << 20, config=FAST
            )
        finally:
            await server.close()

    with pytest.raises(StateFetchError) as info:
        swarm.run(go())
    [(holder, exc)] = info.value.failures
    assert holder == swarm.a.peer_id and exc.code == ErrorCode.WRONG_STEP
    assert f"stage {STAGE} at step {STEP + 1}" in str(info.value) and str(swarm.a.peer_id) in str(info.value)


def test_holder_killed_mid_transfer_resumes_from_another(swarm: Swarm):
    small = StateSyncConfig(chunk_bytes=16 * 1024, connect_timeout_s=5, request_timeout_s=5, deadline_s=60)

    async def go():
        victim = await swarm.peer()
        doomed = StateServer(victim, JOB, holding(BLOB), config=small)
        survivor = StateServer(swarm.b, JOB, holding(BLOB), config=small)
        await doomed.start()
        await survivor.start()
        try:
            fetch = asyncio.create_task(
                fetch_state(
                    swarm.c,
                    [victim.peer_id, swarm.b.peer_id],
                    JOB,
                    STAGE,
                    STEP,
                    max_bytes=8 << 20,
                    config=small,
                )
            )
            while doomed.bytes_served < len(BLOB) // 4:  # every loop turn: stop it a quarter of the way in
                assert not fetch.done()
                await asyncio.sleep(0)
            await swarm.kill(victim)
            return await fetch, doomed.bytes_served, survivor.bytes_served
        finally:
            await survivor.close()

    blob, from_victim, from_survivor = swarm.run(go())
    assert blob == BLOB
    assert from_victim < len(BLOB)  # it really died before the end
    # the survivor sent only what was missing, not the whole blob again (the victim's last
    # ``window`` chunks may have been sent but lost with it)
    assert from_survivor <= len(BLOB) - len(BLOB) // 4 + small.window * small.chunk_bytes
    assert from_survivor >= len(BLOB) - from_victim


def test_corrupt_chunk_fails_the_hash_and_the_next_holder_serves_it(swarm: Swarm):
    async def go():
        async with Hostile(swarm.a, BLOB, "corrupt") as liar:
            honest = StateServer(swarm.b, JOB, holding(BLOB), config=FAST)
            await honest.start()
            try:
                holders = [swarm.a.peer_id, swarm.b.peer_id]
                blob = await fetch_state(swarm.c, holders, JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST)
                return blob, liar.chunks, honest.bytes_served
            finally:
                await honest.close()

    blob, lied_chunks, honest_bytes = swarm.run(go())
    assert blob == BLOB
    assert lied_chunks == -(-len(BLOB) // CHUNK)  # the liar delivered everything (then the hash failed)
    assert honest_bytes == len(BLOB)  # nothing of the liar's was kept


def test_corrupt_chunk_from_the_only_holder_is_a_typed_error(swarm: Swarm):
    async def go():
        async with Hostile(swarm.a, BLOB, "corrupt"):
            await fetch_state(swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST)

    with pytest.raises(StateFetchError) as info:
        swarm.run(go())
    [(_, exc)] = info.value.failures
    assert exc.code == ErrorCode.MALFORMED and "hashes to" in str(exc)


def test_oversized_describe_is_refused_without_allocating(swarm: Swarm):
    async def go():
        async with Hostile(swarm.a, BLOB, "huge") as liar:
            tracemalloc.start()
            try:
                await fetch_state(
                    swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST
                )
            except PeerdError as exc:
                _, peak = tracemalloc.get_traced_memory()
                return exc, peak, liar.chunks
            finally:
                tracemalloc.stop()
        raise AssertionError("a 1 TiB state was accepted")

    exc, peak, chunks = swarm.run(go())
    [(_, cause)] = exc.failures
    assert cause.code == ErrorCode.OVERSIZED and "1099511627776-byte state" in str(cause)
    assert chunks == 0 and peak < 1 << 20


def test_chunk_reply_larger_than_asked_is_refused_on_its_prefix(swarm: Swarm):
    async def go():
        async with Hostile(swarm.a, BLOB, "flood"):
            tracemalloc.start()
            try:
                await fetch_state(
                    swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=FAST
                )
            except PeerdError as exc:
                return exc, tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        raise AssertionError("a 1 GiB chunk was accepted")

    exc, peak = swarm.run(go())
    [(_, cause)] = exc.failures
    assert cause.code == ErrorCode.OVERSIZED and peak < 4 << 20


def test_silent_holder_times_out_and_the_next_serves(swarm: Swarm):
    quick = StateSyncConfig(chunk_bytes=CHUNK, connect_timeout_s=5, request_timeout_s=0.5, deadline_s=60)

    async def silent(conn: Connection) -> None:
        await conn.recv(timeout=30)
        await asyncio.sleep(30)  # never answers; cancelled when the test stops serving

    async def go():
        await swarm.a.serve(state_protocol(JOB), silent)
        honest = StateServer(swarm.b, JOB, holding(BLOB), config=quick)
        await honest.start()
        try:
            holders = [swarm.a.peer_id, swarm.b.peer_id]
            return await fetch_state(swarm.c, holders, JOB, STAGE, STEP, max_bytes=8 << 20, config=quick)
        finally:
            await honest.close()
            await swarm.a.stop_serving(state_protocol(JOB))

    assert swarm.run(go()) == BLOB


def test_too_many_sessions_get_a_typed_busy_refusal(swarm: Swarm, async_wait_until):
    budget = StateSyncConfig(chunk_bytes=CHUNK, request_timeout_s=5, max_sessions=2, max_sessions_per_peer=1)

    async def hold_session(transport: Transport) -> Connection:
        conn = await transport.connect(swarm.a.peer_id, state_protocol(JOB))
        conn.limits = FrameLimits(max_payload=CHUNK)
        await conn.request(header(Describe(stage=STAGE, step=STEP)))  # pins the blob, stays open
        return conn

    async def refusal(transport: Transport) -> PeerdError:
        try:
            await fetch_state(
                transport, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=budget
            )
        except StateFetchError as exc:
            [(_, cause)] = exc.failures
            return cause
        raise AssertionError("a session over the budget was served")

    async def go():
        server = StateServer(swarm.a, JOB, holding(BLOB), config=budget)
        await server.start()
        held: list[Connection] = []
        try:
            held.append(await hold_session(swarm.c))
            per_peer = await refusal(swarm.c)  # c already has its one session
            held.append(await hold_session(swarm.b))
            total = await refusal(swarm.d)  # two sessions in all, none of them d's
            refused = server.refused_busy
            for conn in held:
                await conn.close()
            await async_wait_until(lambda: server.sessions == 0, 20, "the held sessions to end")
            blob = await fetch_state(
                swarm.c, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=budget
            )
            return per_peer, total, refused, blob
        finally:
            for conn in held:
                await conn.close()
            await server.close()

    per_peer, total, refused, blob = swarm.run(go())
    assert per_peer.code == ErrorCode.BUSY and "sessions of this peer" in str(per_peer)
    assert total.code == ErrorCode.BUSY and "2 sessions (at most 2)" in str(total)
    assert refused == 2 and blob == BLOB


def _budget(rate_Bps: float, max_pace_s: float) -> StateSyncConfig:
    """One whole state at once per peer, then ``rate_Bps``; the shared bucket out of the way."""
    return StateSyncConfig(
        chunk_bytes=CHUNK,
        request_timeout_s=10,
        deadline_s=60,
        serve_burst_bytes=len(BLOB) + CHUNK,
        serve_rate_Bps=rate_Bps,
        serve_total_burst_bytes=float(1 << 30),
        serve_total_rate_Bps=float(1 << 30),
        max_pace_s=max_pace_s,
    )


def test_a_peer_asking_for_the_state_again_and_again_gets_it_at_its_budgets_rate(swarm: Swarm):
    """Without a byte budget one peer could make a holder send its state for as long as it liked."""
    config = _budget(rate_Bps=2 << 20, max_pace_s=5.0)

    async def fetch(transport: Transport) -> bytes:
        return await fetch_state(
            transport, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=config
        )

    async def go():
        server = StateServer(swarm.a, JOB, holding(BLOB), config=config)
        await server.start()
        try:
            started = time.monotonic()
            blobs = [await fetch(swarm.c) for _ in range(3)]  # the first from the burst, then paced
            elapsed = time.monotonic() - started
            served, paced = server.bytes_served, server.paced_s
            other = await fetch(swarm.b)  # another peer has a budget of its own
            return blobs, elapsed, served, paced, other, server.paced_s - paced, server.budget.refused
        finally:
            await server.close()

    blobs, elapsed, served, paced, other, other_paced, refused = swarm.run(go(), timeout=120)
    assert blobs == [BLOB] * 3 and other == BLOB and refused == 0  # paced, never refused
    assert served == 3 * len(BLOB)
    assert served <= config.serve_burst_bytes + config.serve_rate_Bps * elapsed + CHUNK
    assert paced > 0 and other_paced == 0


def test_a_peer_whose_budget_would_wait_too_long_is_refused_rate_limited(swarm: Swarm):
    config = _budget(rate_Bps=256 << 10, max_pace_s=0.05)  # a chunk refills in 0.25 s: too long

    async def go():
        server = StateServer(swarm.a, JOB, holding(BLOB), config=config)
        await server.start()
        before = swarm.a.rejections.get(ErrorCode.RATE_LIMITED, 0)
        started = time.monotonic()
        try:
            first = await fetch_state(
                swarm.d, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=config
            )
            try:
                await fetch_state(
                    swarm.d, [swarm.a.peer_id], JOB, STAGE, STEP, max_bytes=8 << 20, config=config
                )
            except StateFetchError as exc:
                [(_, cause)] = exc.failures
            else:
                raise AssertionError("a second whole state was served beyond the budget")
            counted = swarm.a.rejections.get(ErrorCode.RATE_LIMITED, 0) - before
            elapsed = time.monotonic() - started
            return first, cause, server.bytes_served, elapsed, server.budget.refused, counted
        finally:
            await server.close()

    first, cause, served, elapsed, refused, counted = swarm.run(go(), timeout=60)
    assert first == BLOB and cause.code == ErrorCode.RATE_LIMITED and "state byte budget spent" in str(cause)
    assert served <= config.serve_burst_bytes + config.serve_rate_Bps * elapsed + CHUNK
    assert refused == 1 and counted == 1  # counted where peerd status reads it (refusals.handlers)


# ---------------------------------------------------------------- checkpoint replicas


def test_checkpoint_replica_is_served_after_its_stage_is_gone(swarm: Swarm, tmp_path: Path):
    """A's stage checkpoint is replicated to B; with A's server gone, C restores it from B."""
    checkpoint.save(checkpoint.tasklet_dir(tmp_path / "a", JOB, STAGE, 0), make_state())
    quick = StateSyncConfig(chunk_bytes=CHUNK, connect_timeout_s=1, request_timeout_s=5, deadline_s=60)

    async def go():
        owner = StateServer(swarm.a, JOB, own_checkpoints(tmp_path / "a", JOB), config=quick)
        await owner.start()
        store = CheckpointReplicas(tmp_path / "b", budget_bytes=64 << 20)
        try:
            path = await replicate(swarm.b, [swarm.a.peer_id], JOB, STAGE, STEP, store, 8 << 20, config=quick)
            again = await replicate(
                swarm.b, [swarm.a.peer_id], JOB, STAGE, STEP, store, 8 << 20, config=quick
            )
            served_by_owner = owner.bytes_served
        finally:
            await owner.close()  # the stage's peers are gone
        replica = StateServer(swarm.b, JOB, store.provider(JOB), config=quick)
        await replica.start()
        try:
            holders = [swarm.a.peer_id, swarm.b.peer_id]
            blob = await fetch_state(swarm.c, holders, JOB, STAGE, STEP, max_bytes=8 << 20, config=quick)
        finally:
            await replica.close()
        return path, again, served_by_owner, blob

    path, again, served_by_owner, blob = swarm.run(go())
    original = checkpoint.checkpoint_file(checkpoint.tasklet_dir(tmp_path / "a", JOB, STAGE, 0), STEP)
    assert again == path and served_by_owner == original.stat().st_size  # the second call fetched nothing
    assert path.read_bytes() == original.read_bytes() == blob
    restored = unpack_state(blob)
    torch.testing.assert_close(restored["module"]["w"], make_state()["module"]["w"], rtol=0, atol=0)


def test_replicate_refuses_the_checkpoint_of_another_stage(swarm: Swarm, tmp_path: Path):
    other = make_state() | {"stage": STAGE + 1}

    async def go():
        server = StateServer(swarm.a, JOB, holding(pack_state(other)), config=FAST)
        await server.start()
        store = CheckpointReplicas(tmp_path, budget_bytes=64 << 20)
        try:
            await replicate(swarm.b, [swarm.a.peer_id], JOB, STAGE, STEP, store, 8 << 20, config=FAST)
        finally:
            await server.close()
            assert store.steps(JOB, STAGE) == [] and store.used_bytes == 0

    with pytest.raises(ProtocolError) as info:
        swarm.run(go())
    assert info.value.code == ErrorCode.WRONG_STEP and f"stage {STAGE + 1}" in str(info.value)
