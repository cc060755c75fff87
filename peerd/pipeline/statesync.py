"""State transfer between peers: a stage's packed state served in hash-verified chunks and fetched resumably.

A holder (a surviving replica of stage i, or a peer keeping a replica of its checkpoint) runs a
``StateServer`` on the daemon's Transport; a replacement calls ``fetch_state`` with the holders
it knows. On one stream the client first asks ``state.describe`` (answer: the blob's size, its
sha256 and the largest chunk the holder serves), then ``state.chunk`` by offset and length
until it has everything; the assembled blob must hash to what was described. A holder that
vanishes mid-transfer leaves its bytes in place: the next holder that describes the same size
and hash continues from there, any other starts over. A holder that sends something wrong
(bad reply, wrong hash) loses what it sent. Both sides bound what a hostile peer can cost:
the client caps the size the caller accepts, every chunk and every request's time, and the
whole fetch; the server caps sessions per peer and in total, paces the bytes it serves by
per-peer and shared token buckets (a peer asking for the same state over and over gets it at
the refill rate, then RATE_LIMITED), and packs one blob per (stage, step) once, shared while
sessions use it. Spec: protocols/statesync.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import io
import math
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import torch
from msgspec import Meta

from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.swarm.framing import FrameLimits, Header, StreamClosed
from peerd.swarm.limits import BudgetConfig, ByteBudget
from peerd.swarm.transport import Connection, Transport
from peerd.wire import Schema, WireStruct, to_builtin
from peerd.wire.types import Count, Hash32

logger = get_logger(__name__)

PeerRef = Hashable  # a hivemind PeerID, passed through opaquely (this layer does not import hivemind)
StateProvider = Callable[[int, int], bytes | None]
"""``(stage, step) -> packed state`` (``pack_state``), or None when this peer holds no such state.

Called in a worker thread, at most once per (stage, step) while sessions share the result: it
must return a consistent snapshot (read a checkpoint file, or pack a state captured between steps).
"""

VERSION = 1
KIND_DESCRIBE = "state.describe"
KIND_INFO = "state.info"
KIND_CHUNK = "state.chunk"
KIND_DATA = "state.data"

REQUEST_HEADER_BYTES = 4096  # requests are a handful of integers; unknown fields may add a little
REPLY_HEADER_BYTES = 8192  # an error frame's message is up to 1000 characters of UTF-8


def state_protocol(job: str) -> str:
    """The protocol a holder of job ``job``'s state serves."""
    return f"peerd/{job}/state/1"


# ---------------------------------------------------------------- messages (frame headers)

_Length = Annotated[int, Meta(ge=1)]


class _Message(WireStruct, kw_only=True):
    kind: str
    stage: Count
    step: Count
    """The step the state is at: the next step to run, as in the checkpoint file's name."""
    version: int = msgspec.field(default=VERSION, name="v")


class Describe(_Message, kw_only=True):
    """Client -> holder: what is the blob of (stage, step)? Empty payload."""

    kind: str = KIND_DESCRIBE


class Info(_Message, kw_only=True):
    """Holder -> client: the blob's size and sha256, and the largest chunk one request may ask for."""

    kind: str = KIND_INFO
    size: Count
    sha256: Hash32
    chunk: _Length


class ChunkRequest(_Message, kw_only=True):
    """Client -> holder: bytes ``[offset, offset + length)`` of the described blob. Empty payload."""

    kind: str = KIND_CHUNK
    offset: Count
    length: _Length


class Data(_Message, kw_only=True):
    """Holder -> client: the requested bytes as the payload (exactly ``length`` of them)."""

    kind: str = KIND_DATA
    offset: Count
    length: _Length


_SCHEMAS: dict[str, Schema[Any]] = {
    KIND_DESCRIBE: Schema(Describe, "state.describe header", REQUEST_HEADER_BYTES, VERSION, KIND_DESCRIBE),
    KIND_CHUNK: Schema(ChunkRequest, "state.chunk header", REQUEST_HEADER_BYTES, VERSION, KIND_CHUNK),
    KIND_INFO: Schema(Info, "state.info header", REPLY_HEADER_BYTES, VERSION, KIND_INFO),
    KIND_DATA: Schema(Data, "state.data header", REPLY_HEADER_BYTES, VERSION, KIND_DATA),
}
REQUEST_KINDS = (KIND_DESCRIBE, KIND_CHUNK)
REPLY_KINDS = (KIND_INFO, KIND_DATA)


def header(msg: _Message) -> dict[str, Any]:
    """The frame header of ``msg`` (its schema's checks run first: a bug must not reach the wire)."""
    return to_builtin(_SCHEMAS[msg.kind].check(to_builtin(msg)))


def parse(raw: Header, kinds: Sequence[str]) -> Any:
    """The typed message of a frame header whose kind is one of ``kinds``; ProtocolError otherwise."""
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise ProtocolError(
            f"state sync: unexpected message kind {str(kind)[:32]!r}", code=ErrorCode.UNKNOWN_KIND
        )
    return _SCHEMAS[kind].check(raw)


def chunk_plan(size: int, offset: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of the requests that fetch bytes ``[offset, size)`` in pieces of at most ``chunk``."""
    assert chunk >= 1 and 0 <= offset <= size
    for start in range(offset, size, chunk):
        yield start, min(chunk, size - start)


# ---------------------------------------------------------------- blobs


def pack_state(state: dict[str, Any]) -> bytes:
    """``state`` as bytes in the checkpoint file format (``torch.save``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def unpack_state(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The state dict of a packed blob; ProtocolError (MALFORMED) for anything else.

    ``weights_only``: the blob comes from another peer and must not run code when loaded.
    """
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt or foreign blob
        raise ProtocolError(
            f"state blob is not a torch checkpoint: {exc}", code=ErrorCode.MALFORMED
        ) from None
    if not isinstance(state, dict):
        raise ProtocolError(
            f"state blob holds a {type(state).__name__}, not a dict", code=ErrorCode.MALFORMED
        )
    return state


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class StateSyncConfig:
    """Sizes, deadlines and session budgets of state transfer (both sides)."""

    chunk_bytes: int = 4 << 20
    """Largest chunk one request asks for (client) or is served (holder)."""
    connect_timeout_s: float = 10.0
    """Deadline to open a stream to one holder (the Transport retries within it)."""
    request_timeout_s: float = 30.0
    """Deadline for one request's whole reply (a describe may wait for the holder to pack its state)."""
    deadline_s: float = 600.0
    """Deadline for a whole ``fetch_state``, over every holder tried."""
    max_sessions: int = 8
    """Streams a holder serves at once; more get BUSY."""
    max_sessions_per_peer: int = 2
    """Streams a holder serves one peer at once; more get BUSY."""
    session_idle_s: float = 30.0
    """A holder ends a session that sends no request for this long (it stops pinning the blob)."""
    window: int = 4
    """Chunk requests a client keeps in flight on one stream (the holder answers them in order)."""
    # A stage's state is MBs to GBs (GPT3-XL in 4 stages with Adam: ~4 GB): one peer gets a whole
    # state at once, then the refill rate; the shared bucket bounds many identities together.
    serve_burst_bytes: float = float(1 << 30)
    """Holder: bytes one peer may get at once after a quiet while."""
    serve_rate_Bps: float = float(16 << 20)
    """Holder: bytes per second one peer's budget refills (128 Mbit/s)."""
    serve_total_burst_bytes: float = float(2 << 30)
    """Holder: bytes all peers together may get at once."""
    serve_total_rate_Bps: float = float(64 << 20)
    """Holder: bytes per second of the budget all peers share (512 Mbit/s)."""
    max_pace_s: float = 10.0
    """Holder: a chunk waits at most this long for its budget; longer is RATE_LIMITED."""

    def __post_init__(self) -> None:
        for name in ("chunk_bytes", "max_sessions", "max_sessions_per_peer", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"statesync.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "request_timeout_s", "deadline_s", "session_idle_s", "max_pace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"statesync.{name}", f"must be > 0 s, got {getattr(self, name)}")
        for name in (
            "serve_burst_bytes",
            "serve_rate_Bps",
            "serve_total_burst_bytes",
            "serve_total_rate_Bps",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"statesync.{name}", f"must be a finite number > 0, got {value!r}")

    @property
    def serve_budget(self) -> BudgetConfig:
        return BudgetConfig(
            rate_Bps=self.serve_rate_Bps,
            burst_bytes=self.serve_burst_bytes,
            total_rate_Bps=self.serve_total_rate_Bps,
            total_burst_bytes=self.serve_total_burst_bytes,
        )


# ---------------------------------------------------------------- the holder


@dataclass(frozen=True)
class _Blob:
    data: bytes
    sha256: bytes


@dataclass
class _Entry:
    packing: asyncio.Task[_Blob | None]
    users: int = 0


class StateServer:
    """Serves ``state_protocol(job)``: describe and chunk requests for the blobs ``provider`` packs."""

    def __init__(
        self,
        transport: Transport,
        job: str,
        provider: StateProvider,
        *,
        config: StateSyncConfig = StateSyncConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.job = job
        self.protocol = state_protocol(job)
        self.provider = provider
        self.config = config
        self.packs = 0  # provider calls (the cache shares one per (stage, step) between sessions)
        self.refused_busy = 0
        self.bytes_served = 0
        self.budget = ByteBudget(config.serve_budget, clock)  # .refused: chunks refused RATE_LIMITED
        self.paced_s = 0.0  # time chunks waited for their budget
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._sessions: dict[PeerRef, int] = {}
        self._serving = False

    @property
    def sessions(self) -> int:
        return sum(self._sessions.values())

    @property
    def cached(self) -> list[tuple[int, int]]:
        """(stage, step) of the blobs held in memory now (only while a session uses them)."""
        return sorted(self._entries)

    async def start(self) -> None:
        limits = FrameLimits(max_header=REQUEST_HEADER_BYTES, max_payload=0)  # requests carry no payload
        await self.transport.serve(self.protocol, self._handle, limits=limits)
        self._serving = True

    async def close(self) -> None:
        if self._serving:
            self._serving = False
            await self.transport.stop_serving(self.protocol)
        for entry in self._entries.values():
            entry.packing.cancel()
        self._entries.clear()

    async def _handle(self, conn: Connection) -> None:
        peer = conn.peer_id
        mine = self._sessions.get(peer, 0)
        if self.sessions >= self.config.max_sessions or mine >= self.config.max_sessions_per_peer:
            self.refused_busy += 1
            why = (
                f"{mine} sessions of this peer (at most {self.config.max_sessions_per_peer})"
                if mine >= self.config.max_sessions_per_peer
                else f"{self.sessions} sessions (at most {self.config.max_sessions})"
            )
            logger.info("state sync: refused a session from %s: %s", peer, why)
            await conn.send_error(ErrorCode.BUSY, f"state holder busy: {why}")
            return
        self._sessions[peer] = mine + 1
        try:
            await self._session(conn)
        finally:
            self._sessions[peer] -= 1
            if not self._sessions[peer]:
                del self._sessions[peer]

    async def _session(self, conn: Connection) -> None:
        key: tuple[int, int] | None = None
        blob: _Blob | None = None
        try:
            while True:
                try:
                    raw, _ = await conn.recv(timeout=self.config.session_idle_s)
                except StreamClosed:
                    return
                msg = parse(raw, REQUEST_KINDS)
                if isinstance(msg, Describe):
                    if key != (msg.stage, msg.step):
                        if key is not None:
                            self._release(key)
                            key = blob = None
                        blob = await self._acquire((msg.stage, msg.step))
                        key = (msg.stage, msg.step)
                    assert blob is not None
                    info = Info(
                        stage=msg.stage,
                        step=msg.step,
                        size=len(blob.data),
                        sha256=blob.sha256,
                        chunk=self.config.chunk_bytes,
                    )
                    await conn.send(header(info), timeout=self.config.request_timeout_s)
                else:
                    await self._send_chunk(conn, msg, key, blob)
        except (
            ProtocolError
        ) as exc:  # told to the client in our words (the Transport would add the code twice)
            logger.info("state sync: request from %s refused: %s", conn.peer_id, exc)
            with contextlib.suppress(PeerdError):
                await conn.send_error(exc.code, exc.message)
        finally:
            if key is not None:
                self._release(key)

    async def _send_chunk(
        self, conn: Connection, msg: ChunkRequest, key: tuple[int, int] | None, blob: _Blob | None
    ) -> None:
        if blob is None or key != (msg.stage, msg.step):
            raise ProtocolError(
                f"chunk of stage {msg.stage} step {msg.step} requested before describing it",
                code=ErrorCode.MALFORMED,
            )
        if msg.length > self.config.chunk_bytes:
            raise ProtocolError(
                f"chunk of {msg.length} B asked, this holder serves at most {self.config.chunk_bytes} B",
                code=ErrorCode.OVERSIZED,
            )
        if msg.offset + msg.length > len(blob.data):
            raise ProtocolError(
                f"chunk [{msg.offset}, {msg.offset + msg.length}) lies beyond the {len(blob.data)}-byte blob",
                code=ErrorCode.MALFORMED,
            )
        await self._pace(conn.peer_id, msg.length)
        data = Data(stage=msg.stage, step=msg.step, offset=msg.offset, length=msg.length)
        view = memoryview(blob.data)[msg.offset : msg.offset + msg.length]
        await conn.send(header(data), view, timeout=self.config.request_timeout_s)
        self.bytes_served += msg.length

    async def _pace(self, peer: PeerRef, nbytes: int) -> None:
        """Wait until ``peer``'s budget covers ``nbytes``; RATE_LIMITED if that is over ``max_pace_s``.

        The bytes are charged before the wait, so the other sessions of the peer (and of everyone,
        for the shared bucket) queue behind them instead of all waking up at once.
        """
        wait = self.budget.wait_s(peer, nbytes)
        if wait > self.config.max_pace_s:
            self.budget.refused += 1
            raise PeerUnavailable(
                f"state byte budget spent ({self.config.serve_burst_bytes:.0f} B at once, "
                f"{self.config.serve_rate_Bps:.0f} B/s per peer); retry in {wait:.1f} s",
                code=ErrorCode.RATE_LIMITED,
            )
        self.budget.charge(peer, nbytes)
        if wait > 0:
            self.paced_s += wait
            await asyncio.sleep(wait)

    async def _acquire(self, key: tuple[int, int]) -> _Blob:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(asyncio.create_task(self._pack(*key)))
        entry.users += 1
        try:
            # shielded: a session that goes away must not cancel a pack others are waiting for
            blob = await asyncio.shield(entry.packing)
        except BaseException:
            self._release(key)
            raise
        if blob is None:
            self._release(key)
            raise ProtocolError(
                f"this peer holds no state of stage {key[0]} at step {key[1]}", code=ErrorCode.WRONG_STEP
            )
        return blob

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.users -= 1
        if entry.users <= 0:  # nobody reads it any more: let the memory go
            del self._entries[key]
            entry.packing.cancel()

    async def _pack(self, stage: int, step: int) -> _Blob | None:
        self.packs += 1

        def pack() -> _Blob | None:
            data = self.provider(stage, step)
            if data is None:
                return None
            data = data if isinstance(data, bytes) else bytes(data)  # immutable while sessions share it
            return _Blob(data, hashlib.sha256(data).digest())

        started = time.perf_counter()
        blob = await asyncio.to_thread(pack)
        if blob is not None:
            logger.debug(
                "state sync: packed stage %d step %d: %d B in %.3f s",
                stage,
                step,
                len(blob.data),
                time.perf_counter() - started,
            )
        return blob


# ---------------------------------------------------------------- the client


class StateFetchError(PeerUnavailable):
    """No holder delivered the state; ``failures`` says what went wrong with each one tried."""

    def __init__(self, message: str, failures: list[tuple[PeerRef, PeerdError]], *, code: ErrorCode) -> None:
        super().__init__(message, code=code)
        self.failures = failures


@dataclass
class Assembly:
    """The bytes of one blob received so far and the size and sha256 they must add up to (pure).

    Chunks arrive in order, so the received bytes are always a prefix; the hash is updated as
    they come and the whole blob is joined once at the end.
    """

    max_bytes: int
    expected_sha256: bytes | None = None
    size: int | None = None
    sha256: bytes | None = None
    received: int = 0
    sources: list[PeerRef] = field(default_factory=list)
    _parts: list[bytes | bytearray] = field(default_factory=list, init=False, repr=False)
    _hasher: Any = field(default_factory=hashlib.sha256, init=False, repr=False)

    def adopt(self, holder: PeerRef, info: Info) -> int:
        """Take ``holder``'s description; return the offset to continue from (0: start over)."""
        if info.size > self.max_bytes:
            raise ProtocolError(
                f"{holder} describes a {info.size}-byte state, more than the {self.max_bytes} B accepted",
                code=ErrorCode.OVERSIZED,
            )
        if self.expected_sha256 is not None and info.sha256 != self.expected_sha256:
            raise ProtocolError(
                f"{holder} holds a state with sha256 {info.sha256.hex()[:16]}..., "
                f"not the expected {self.expected_sha256.hex()[:16]}...",
                code=ErrorCode.STALE,
            )
        if (info.size, info.sha256) != (self.size, self.sha256):
            if self.received:
                logger.info(
                    "state sync: %s holds another blob than the %d/%d B received so far: starting over",
                    holder,
                    self.received,
                    self.size,
                )
            self.reset()
            self.size, self.sha256 = info.size, info.sha256
        if holder not in self.sources:
            self.sources.append(holder)
        return self.received

    def add(self, offset: int, data: bytes | bytearray) -> None:
        assert self.size is not None and offset == self.received, (offset, self.received)
        assert self.received + len(data) <= self.size
        self._parts.append(data)
        self._hasher.update(data)
        self.received += len(data)

    @property
    def complete(self) -> bool:
        return self.size is not None and self.received == self.size

    def finish(self) -> bytes:
        """The blob, if its sha256 matches the description; ProtocolError (MALFORMED) otherwise."""
        assert self.complete
        got = self._hasher.digest()
        if got != self.sha256:
            assert self.sha256 is not None
            raise ProtocolError(
                f"state from {', '.join(map(str, self.sources))} hashes to {got.hex()[:16]}..., "
                f"described as {self.sha256.hex()[:16]}... (corrupt bytes)",
                code=ErrorCode.MALFORMED,
            )
        return b"".join(self._parts)

    def reset(self) -> None:
        self.size = self.sha256 = None
        self.received = 0
        self.sources.clear()
        self._parts.clear()
        self._hasher = hashlib.sha256()


async def fetch_state(
    transport: Transport,
    holders: Sequence[PeerRef],
    job: str,
    stage: int,
    step: int,
    *,
    max_bytes: int,
    config: StateSyncConfig = StateSyncConfig(),
    expected_sha256: bytes | None = None,
) -> bytes:
    """The packed state of ``stage`` at ``step``, from the first of ``holders`` that can deliver it.

    Holders are tried in order, each at most once; see the module doc for resuming. Raises
    StateFetchError naming each holder's failure, with code TIMEOUT when ``config.deadline_s``
    ran out. ``expected_sha256``: accept only that blob (e.g. a hash published with the checkpoint).
    """
    if not holders:
        raise StateFetchError(
            f"no holder of stage {stage} step {step} to fetch from", [], code=ErrorCode.PEER_UNAVAILABLE
        )
    assembly = Assembly(max_bytes, expected_sha256)
    failures: list[tuple[PeerRef, PeerdError]] = []
    started = time.perf_counter()
    what = f"state of job {job} stage {stage} step {step}"
    try:
        async with asyncio.timeout(config.deadline_s):
            for holder in holders:
                try:
                    await _fetch_from(transport, holder, job, stage, step, assembly, config)
                    blob = assembly.finish()
                except PeerdError as exc:
                    failures.append((holder, exc))
                    if _vanished(exc):  # what it sent stays for the next holder (the hash still covers it)
                        logger.warning(
                            "state sync: %s from %s stopped at %d B: %s",
                            what,
                            holder,
                            assembly.received,
                            exc,
                        )
                    else:  # it sent something wrong: nothing it sent is kept
                        logger.warning("state sync: %s from %s refused: %s", what, holder, exc)
                        assembly.reset()
                    continue
                elapsed = time.perf_counter() - started
                logger.info(
                    "state sync: %s: %d B from %s in %.2f s",
                    what,
                    len(blob),
                    ", ".join(map(str, assembly.sources)),
                    elapsed,
                )
                return blob
    except TimeoutError:
        raise StateFetchError(
            f"no {what} within {config.deadline_s:g} s ({assembly.received} B received){_summary(failures)}",
            failures,
            code=ErrorCode.TIMEOUT,
        ) from None
    raise StateFetchError(
        f"no holder delivered the {what}{_summary(failures)}", failures, code=ErrorCode.PEER_UNAVAILABLE
    )


def _vanished(exc: PeerdError) -> bool:
    """The holder went away or stalled (a stream cut inside a frame reads as TRUNCATED)."""
    return isinstance(exc, PeerUnavailable) or exc.code == ErrorCode.TRUNCATED


def _summary(failures: list[tuple[PeerRef, PeerdError]]) -> str:
    return "".join(f"; {holder}: {exc.message} [{exc.code.name}]" for holder, exc in failures)


async def _fetch_from(
    transport: Transport,
    holder: PeerRef,
    job: str,
    stage: int,
    step: int,
    assembly: Assembly,
    config: StateSyncConfig,
) -> None:
    conn = await transport.connect(holder, state_protocol(job), timeout=config.connect_timeout_s)
    hashing: asyncio.Future[None] | None = None
    try:
        # replies larger than the chunk this client asks for fail on their prefix, before any read
        conn.limits = FrameLimits(max_header=REPLY_HEADER_BYTES, max_payload=config.chunk_bytes)
        await _send(conn, holder, Describe(stage=stage, step=step), config)
        info = parse((await _recv(conn, holder, KIND_DESCRIBE, config))[0], (KIND_INFO,))
        if (info.stage, info.step) != (stage, step):
            raise ProtocolError(
                f"{holder} described stage {info.stage} step {info.step}, asked for stage {stage} step {step}",
                code=ErrorCode.WRONG_STEP,
            )
        plan = chunk_plan(info.size, assembly.adopt(holder, info), min(config.chunk_bytes, info.chunk))
        asked: collections.deque[tuple[int, int]] = collections.deque()

        async def ask_next() -> None:
            if (nxt := next(plan, None)) is not None:
                await _send(
                    conn, holder, ChunkRequest(stage=stage, step=step, offset=nxt[0], length=nxt[1]), config
                )
                asked.append(nxt)

        for _ in range(config.window):  # requests in flight hide the round trip between chunks
            await ask_next()
        while asked:
            start, length = asked.popleft()
            raw, payload = await _recv(conn, holder, KIND_CHUNK, config)
            data = parse(raw, (KIND_DATA,))
            if (data.stage, data.step, data.offset, data.length, len(payload)) != (
                stage,
                step,
                start,
                length,
                length,
            ):
                raise ProtocolError(
                    f"{holder} answered chunk [{start}, {start + length}) of stage {stage} step {step} with "
                    f"stage {data.stage} step {data.step} [{data.offset}, {data.offset + data.length}) "
                    f"and {len(payload)} payload bytes",
                    code=ErrorCode.MALFORMED,
                )
            await ask_next()
            if hashing is not None:
                await hashing
            # hashed in a thread (hashlib lets go of the GIL) while the next chunk streams in
            hashing = asyncio.ensure_future(asyncio.to_thread(assembly.add, start, payload))
        if hashing is not None:
            await hashing
    finally:
        if hashing is not None and not hashing.done():
            await asyncio.wait([hashing])  # the assembly is consistent before anyone else reads it
        await conn.close(timeout=1.0)


async def _send(conn: Connection, holder: PeerRef, msg: _Message, config: StateSyncConfig) -> None:
    try:
        await conn.send(header(msg), timeout=config.request_timeout_s)
    except PeerdError as exc:
        raise _named(exc, holder, msg.kind) from None


async def _recv(
    conn: Connection, holder: PeerRef, asked: str, config: StateSyncConfig
) -> tuple[Header, bytearray]:
    timeout = config.request_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await conn.recv(timeout=timeout)
    except TimeoutError:
        raise PeerUnavailable(
            f"{holder} did not answer {asked} within {timeout:g} s", code=ErrorCode.TIMEOUT
        ) from None
    except PeerdError as exc:
        raise _named(exc, holder, asked) from None


def _named(exc: PeerdError, holder: PeerRef, asked: str) -> PeerdError:
    """``exc`` with the holder's name in front; a refusal it sent reads as its own words."""
    text = exc.message.removeprefix("remote: ")
    text = f"{holder} refused {asked}: {text}" if text != exc.message else f"{holder}: {text}"
    cls = PeerUnavailable if isinstance(exc, PeerUnavailable) else type(exc)
    return cls(text, code=exc.code)
