"""Activation/gradient streams between allocated pipeline neighbours over the peerd Transport.

Each stage serves one protocol (``stage_protocol``) that only its allocated upstream and
downstream peers may open (others get NOT_ALLOWED from the Transport). A sender keeps one
persistent connection per neighbour and direction and delivers messages reliably and in
order, the way go-back-N does: every message has a sequence number, the receiver acks what
it accepted and nacks (with the ErrorCode) what it rejected; on a nack or a broken stream the
sender resends from the first unacknowledged message, up to a budget, then fails the step
with a typed error. In-order delivery matters because AC-SGD's per-example buffers must see
the same sequence on both sides. Every wait has a timeout, so a dead or misbehaving neighbour
ends in an error, never a hung pipeline. Counters: wire bytes per (boundary, direction),
rejections per error code, resends and reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peerd.errors import CodecError, ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.pipeline.frames import (
    KIND_ABORT,
    KIND_ACT,
    KIND_GRAD,
    Abort,
    Ack,
    Assembler,
    Expectation,
    Nack,
    TensorMessage,
    abort_header,
    ack_header,
    check_message,
    nack_header,
    parse_control,
    parse_part,
    part_header,
    part_spans,
)
from peerd.swarm.framing import FrameLimits, StreamClosed
from peerd.swarm.transport import Connection, Transport

logger = get_logger(__name__)

PeerRef = Hashable  # a hivemind PeerID, passed through opaquely (this layer does not import hivemind)


class MessageDecoder(Protocol):
    """Turns an accepted message's payload into its tensor (``peerd.pipeline.codec`` decoders)."""

    inline: bool  # always cheap enough for the event loop (else only small messages are decoded there)

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor: ...


Tamper = Callable[[TensorMessage, int, list[tuple[dict, memoryview]]], list[tuple[dict, Any]]]


def stage_protocol(job: str, stage: int) -> str:
    """The protocol stage ``stage`` of job ``job`` serves (its neighbours open it)."""
    return f"peerd/pp/1/{job}/s{stage}"


def direction(kind: str) -> str:
    return "fwd" if kind == KIND_ACT else "bwd"


@dataclass(frozen=True)
class StreamConfig:
    """Sizes, deadlines and retry budgets of the pipeline streams."""

    chunk_bytes: int = 4 << 20
    """Largest payload of one frame; bigger messages travel as several parts."""
    connect_timeout_s: float = 20.0
    """Deadline to open a stream to a neighbour (the Transport retries within it)."""
    recv_timeout_s: float = 120.0
    """How long a stage waits for a neighbour's message (covers its compute and averaging)."""
    stall_timeout_s: float = 60.0
    """A started frame that makes no progress for this long breaks the stream."""
    ack_timeout_s: float = 120.0
    """How long ``flush`` waits for the receiver to accept everything sent."""
    max_resends: int = 3
    """Nacks for one message before the sender gives up (the step fails)."""
    max_reconnects: int = 3
    """Consecutive broken streams to one neighbour before the sender gives up."""
    window: int = 64
    """Unacknowledged messages before ``send`` waits."""
    inline_decode_bytes: int = 256 * 1024
    """Messages up to this size are decoded on the event loop: a thread hop costs more than the
    decode when the loop is busy (GIL hand-over), measured at tens of ms on 2 busy cores."""

    def validate(self) -> None:
        if self.chunk_bytes < 1024:
            raise ConfigError("chunk_bytes", f"must be >= 1024, got {self.chunk_bytes}")
        for name in ("connect_timeout_s", "recv_timeout_s", "stall_timeout_s", "ack_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.max_resends < 0 or self.max_reconnects < 0 or self.window < 1:
            raise ConfigError("max_resends", "budgets must be >= 0 and the window >= 1")


@dataclass
class LinkCounters:
    """Traffic of one boundary and direction as seen from this stage."""

    wire_bytes: int = 0  # frames of messages: prefix + header + payload
    payload_bytes: int = 0
    messages: int = 0
    frames: int = 0


@dataclass
class StreamStats:
    """Counters of one stage's streams (both its sender and its receiver side)."""

    sent: dict[tuple[int, str], LinkCounters] = field(default_factory=dict)
    received: dict[tuple[int, str], LinkCounters] = field(default_factory=dict)
    control_bytes: int = 0  # acks/nacks/aborts sent and received
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    resends: int = 0
    reconnects: int = 0
    duplicates: int = 0
    out_of_order: int = 0

    def link(self, side: str, boundary: int, kind: str) -> LinkCounters:
        table = self.sent if side == "sent" else self.received
        return table.setdefault((boundary, direction(kind)), LinkCounters())

    def reject(self, code: ErrorCode) -> None:
        self.rejected[code.name] += 1

    def wire_bytes(self) -> dict[str, int]:
        """``{"b0.fwd.sent": n, ...}``: wire bytes per boundary, direction and side."""
        out = {}
        for side, table in (("sent", self.sent), ("received", self.received)):
            for (b, d), c in sorted(table.items()):
                out[f"b{b}.{d}.{side}"] = c.wire_bytes
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            "wire_bytes": self.wire_bytes(),
            "control_bytes": self.control_bytes,
            "rejected": dict(self.rejected),
            "resends": self.resends,
            "reconnects": self.reconnects,
            "duplicates": self.duplicates,
            "out_of_order": self.out_of_order,
        }


class Inbox:
    """Accepted tensors by ``(kind, step, mb)``, and the step window the receiver validates against."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self._slots: dict[tuple[str, int, int], asyncio.Future[torch.Tensor]] = {}
        self._error: PeerdError | None = None

    @property
    def error(self) -> PeerdError | None:
        return self._error

    def _slot(self, key: tuple[str, int, int]) -> asyncio.Future[torch.Tensor]:
        fut = self._slots.get(key)
        if fut is None:
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        return fut

    def put(self, key: tuple[str, int, int], tensor: torch.Tensor) -> None:
        fut = self._slot(key)
        if fut.done():  # sequence numbers make this impossible for one honest sender
            raise ProtocolError(f"second message for {key}", code=ErrorCode.MALFORMED)
        fut.set_result(tensor)

    async def get(self, kind: str, step: int, mb: int, timeout: float) -> torch.Tensor:
        """The tensor for ``(kind, step, mb)``; PeerUnavailable(TIMEOUT) if it does not come in time."""
        if self._error is not None:
            raise self._error
        key = (kind, step, mb)
        fut = self._slot(key)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except TimeoutError:
            if self._error is not None:
                raise self._error from None
            raise PeerUnavailable(
                f"no {kind} for step {step} micro-batch {mb} within {timeout:.3g} s", code=ErrorCode.TIMEOUT
            ) from None
        finally:
            if fut.done():
                self._slots.pop(key, None)

    def advance(self, step: int) -> None:
        """Start step ``step``: frames for ``step`` and ``step + 1`` are accepted from now on."""
        self.step = step
        for key in [k for k in self._slots if k[1] < step]:
            fut = self._slots.pop(key)
            if not fut.done():
                fut.cancel()

    def fail(self, exc: PeerdError) -> None:
        """Wake every waiter with ``exc`` (a stream failed, a neighbour aborted)."""
        if self._error is None:
            self._error = exc
        for fut in self._slots.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved here: a slot nobody waits on must not log "never retrieved"


# ---------------------------------------------------------------- sending side


@dataclass
class _Outgoing:
    msg: TensorMessage
    payload: memoryview
    attempts: int = 0
    nacks: int = 0


class StreamSender:
    """Reliable, ordered delivery of one direction's messages to one neighbour (see the module doc)."""

    def __init__(
        self,
        transport: Transport,
        peer: PeerRef,
        protocol: str,
        *,
        config: StreamConfig,
        stats: StreamStats,
        on_failure: Callable[[PeerdError], None] | None = None,
    ) -> None:
        self.transport = transport
        self.peer = peer
        self.protocol = protocol
        self.config = config
        self.stats = stats
        self.on_failure = on_failure
        self.tamper: Tamper | None = None
        """Test and debugging hook: rewrites the frames of one transmission attempt."""
        self._seq = 0
        self._unacked: collections.OrderedDict[int, _Outgoing] = collections.OrderedDict()
        self._send_from = 0  # lowest seq not yet transmitted on the current connection
        self._conn: Connection | None = None
        self._changed = asyncio.Event()
        self._error: PeerdError | None = None
        self._failures = 0  # consecutive broken connections
        self._pump: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None

    @property
    def error(self) -> PeerdError | None:
        return self._error

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        """Open the connection now (so a refused neighbour fails at start-up, not at the first send)."""
        await self._connect()
        self._pump = asyncio.create_task(self._run(), name=f"peerd-pp-send-{self.protocol}")

    async def send(self, msg: TensorMessage, payload: memoryview | bytes | bytearray) -> None:
        """Queue ``msg`` (its ``seq`` is overwritten); returns when queued, waiting while the window is full."""
        view = memoryview(payload).cast("B")
        assert view.nbytes == msg.nbytes, "message nbytes must match its payload"
        try:
            async with asyncio.timeout(self.config.ack_timeout_s):
                while len(self._unacked) >= self.config.window and self._error is None:
                    await self._wait_change()
        except TimeoutError:
            raise PeerUnavailable(
                f"{self.peer} accepted nothing for {self.config.ack_timeout_s:.3g} s", code=ErrorCode.TIMEOUT
            ) from None
        self._raise_if_failed()
        seq = self._seq
        self._seq += 1
        self._unacked[seq] = _Outgoing(_with_seq(msg, seq), view)
        self._changed.set()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the receiver accepted every queued message."""
        timeout = self.config.ack_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                while self._unacked and self._error is None:
                    await self._wait_change()
        except TimeoutError:
            raise PeerUnavailable(
                f"{self.peer} did not accept {len(self._unacked)} messages within {timeout:.3g} s",
                code=ErrorCode.TIMEOUT,
            ) from None
        self._raise_if_failed()

    async def abort(self, step: int, code: ErrorCode, message: str) -> None:
        """Best effort: tell the neighbour this stage gave up on ``step`` (so it fails fast, not by timeout)."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        with contextlib.suppress(PeerdError, OSError, RuntimeError):
            await conn.send(abort_header(step, code, message), timeout=2.0)

    async def close(self) -> None:
        for task in (self._pump, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._conn is not None:
            await self._conn.close(timeout=2.0)
            self._conn = None

    # -- internals

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: PeerdError) -> None:
        if self._error is None:
            self._error = exc
            logger.warning("stream %s to %s failed: %s", self.protocol, self.peer, exc)
            if self.on_failure is not None:
                self.on_failure(exc)
        self._changed.set()

    async def _connect(self) -> None:
        conn = await self.transport.connect(self.peer, self.protocol, timeout=self.config.connect_timeout_s)
        self._conn = conn
        self._send_from = next(iter(self._unacked), self._seq)  # everything unacked goes again
        self._reader = asyncio.create_task(self._read(conn), name=f"peerd-pp-acks-{self.protocol}")

    async def _run(self) -> None:
        while self._error is None:
            try:
                pending = next((o for s, o in self._unacked.items() if s >= self._send_from), None)
                if pending is None:
                    await self._wait_change()
                    continue
                conn = self._conn
                if conn is None or conn.closed:  # reconnect only when there is something to send
                    await self._reconnect()
                    continue
                await self._transmit(conn, pending)
                self._send_from = pending.msg.seq + 1
            except PeerUnavailable as exc:
                await self._broken(exc)
            except PeerdError as exc:  # a frame we built was refused by our own encoder: a bug
                self._fail(exc)
            except asyncio.CancelledError:
                raise

    async def _broken(self, exc: PeerdError) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close(timeout=0.1)
        # what was sent but not acknowledged may be lost with the stream: it goes again
        self._send_from = next(iter(self._unacked), self._seq)
        logger.info("stream %s to %s broke: %s", self.protocol, self.peer, exc)
        self._changed.set()

    async def _reconnect(self) -> None:
        self._failures += 1
        self.stats.reconnects += 1
        if self._failures > self.config.max_reconnects:
            self._fail(PeerUnavailable(f"stream {self.protocol} to {self.peer} broke {self._failures} times"))
            return
        if self._reader is not None:
            self._reader.cancel()
        try:
            await self._connect()
        except PeerUnavailable as exc:
            self._fail(exc)

    async def _transmit(self, conn: Connection, out: _Outgoing) -> None:
        msg = out.msg
        out.attempts += 1
        if out.attempts > 1:
            self.stats.resends += 1
        spans = part_spans(msg.nbytes, self.config.chunk_bytes)
        frames: list[tuple[dict, Any]] = [
            (part_header(msg, i, len(spans), off), out.payload[off : off + length])
            for i, (off, length) in enumerate(spans)
        ]
        if self.tamper is not None:
            frames = self.tamper(msg, out.attempts, frames)
        counters = self.stats.link("sent", msg.boundary, msg.kind)
        for header, payload in frames:
            before = conn.bytes_sent
            await conn.send(header, payload, timeout=self.config.stall_timeout_s)
            counters.wire_bytes += conn.bytes_sent - before
            counters.payload_bytes += memoryview(payload).nbytes
            counters.frames += 1
        counters.messages += 1

    async def _read(self, conn: Connection) -> None:
        """Acks and nacks from the receiver; a broken stream wakes the pump to reconnect."""
        try:
            while True:
                before = conn.bytes_received
                try:
                    header, _ = await conn.recv(timeout=self.config.stall_timeout_s)
                except PeerUnavailable as exc:
                    if exc.code == ErrorCode.TIMEOUT and not conn.closed:
                        continue  # idle between steps
                    raise
                self.stats.control_bytes += conn.bytes_received - before
                self._on_control(parse_control(header))
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            if exc.code == ErrorCode.NOT_ALLOWED:
                self._fail(exc)  # we are not (or no longer) this peer's neighbour: retrying cannot help
            elif conn is self._conn:
                await self._broken(exc)
        except PeerdError as exc:
            if conn is self._conn:
                await self._broken(exc)

    def _on_control(self, ctl: Ack | Nack | Abort) -> None:
        if isinstance(ctl, Ack):
            while self._unacked and next(iter(self._unacked)) <= ctl.seq:
                self._unacked.popitem(last=False)
            self._failures = 0
        elif isinstance(ctl, Nack):
            out = self._unacked.get(ctl.seq)
            if out is None:
                return  # a nack for a message already accepted on a later attempt
            out.nacks += 1
            if out.nacks > self.config.max_resends:
                self._fail(
                    ProtocolError(
                        f"{self.peer} rejected message seq {ctl.seq} (step {out.msg.step}, mb {out.msg.mb}) "
                        f"{out.nacks} times; last: {ctl.message}",
                        code=ctl.code,
                    )
                )
                return
            logger.info(
                "%s rejected seq %d (%s): %s; resending", self.peer, ctl.seq, ctl.code.name, ctl.message
            )
            self._send_from = min(self._send_from, ctl.seq)
        else:
            self._fail(ProtocolError(f"neighbour aborted step {ctl.step}: {ctl.message}", code=ctl.code))
        self._changed.set()


def _with_seq(msg: TensorMessage, seq: int) -> TensorMessage:
    return dataclasses.replace(msg, seq=seq)


# ---------------------------------------------------------------- receiving side


class StreamReceiver:
    """Serves a stage's protocol: validates, decodes and acks its neighbours' messages into the inbox."""

    def __init__(
        self,
        *,
        upstream: PeerRef | None,
        downstream: PeerRef | None,
        expectations: dict[str, Callable[[int], Expectation]],
        decoders: dict[str, MessageDecoder],
        inbox: Inbox,
        stats: StreamStats,
        config: StreamConfig,
    ) -> None:
        self.upstream = upstream
        self.downstream = downstream
        self.expectations = expectations  # kind -> (current step) -> Expectation
        self.decoders = decoders
        self.inbox = inbox
        self.stats = stats
        self.config = config
        self._next_seq: dict[tuple[PeerRef, str], int] = {}
        self._decode_locks: dict[str, asyncio.Lock] = {}

    def allowed(self, peer: PeerRef) -> bool:
        return peer is not None and peer in (self.upstream, self.downstream)

    def limits(self) -> FrameLimits:
        return FrameLimits(max_payload=self.config.chunk_bytes)

    async def serve(self, transport: Transport, protocol: str) -> None:
        await transport.serve(protocol, self.handle, allowed=self.allowed, limits=self.limits())

    async def handle(self, conn: Connection) -> None:
        """One neighbour's stream: runs until it closes; out-of-sync bytes end it with a typed error."""
        assembler = Assembler()
        while True:
            before = conn.bytes_received
            try:
                header, payload = await conn.recv(timeout=self.config.stall_timeout_s)
            except StreamClosed:
                return
            except PeerUnavailable as exc:
                if exc.code == ErrorCode.TIMEOUT and not conn.closed:
                    continue  # idle: the persistent connection waits for the next step
                raise
            except ProtocolError as exc:  # the byte stream itself is broken: count, then end it
                self.stats.reject(exc.code)
                raise
            wire = conn.bytes_received - before
            kind = header["kind"]
            if kind == KIND_ABORT:
                self.stats.control_bytes += wire
                await self._aborted(conn, header)
                continue
            try:
                await self._on_data(conn, assembler, header, payload, wire)
            except (ProtocolError, CodecError) as exc:
                assembler.reset()
                self.stats.reject(exc.code)
                logger.info("rejected a frame from %s: %s", conn.peer_id, exc)
                seq = header.get("seq")
                await conn.send(nack_header(seq if _is_seq(seq) else -1, exc.code, plain(exc)), timeout=5.0)

    async def _aborted(self, conn: Connection, header: dict) -> None:
        try:
            ctl = parse_control(header)
        except ProtocolError as exc:
            self.stats.reject(exc.code)
            return
        assert isinstance(ctl, Abort)
        error = ProtocolError(
            f"neighbour {conn.peer_id} aborted step {ctl.step}: {ctl.message}", code=ctl.code
        )
        self.inbox.fail(error)

    async def _on_data(
        self, conn: Connection, assembler: Assembler, header: dict, payload: bytearray, wire: int
    ) -> None:
        part = parse_part(header)
        msg = part.message
        kinds = {KIND_ACT} if conn.peer_id == self.upstream else set()
        if conn.peer_id == self.downstream:
            kinds.add(KIND_GRAD)
        if msg.kind not in kinds:
            raise ProtocolError(
                f"{msg.kind} frames must come from the {'upstream' if msg.kind == KIND_ACT else 'downstream'} "
                "neighbour",
                code=ErrorCode.NOT_ALLOWED,
            )
        stream_key = (conn.peer_id, msg.kind)
        expected_seq = self._next_seq.get(stream_key, 0)
        duplicate = msg.seq < expected_seq
        if part.index == 0 and not duplicate:
            check_message(msg, self.expectations[msg.kind](self.inbox.step))
        counters = self.stats.link("received", msg.boundary, msg.kind)
        counters.wire_bytes += wire
        counters.payload_bytes += len(payload)
        counters.frames += 1
        done = assembler.feed(part, payload)
        if done is None:
            return
        msg, buf = done
        counters.messages += 1
        if duplicate:  # a resend of something we accepted (its ack was lost): ack again
            self.stats.duplicates += 1
            await self._ack(conn, expected_seq - 1)
            return
        if msg.seq > expected_seq:  # an earlier message was rejected; the sender goes back to it
            self.stats.out_of_order += 1
            return
        decoder = self.decoders[msg.kind]
        if decoder.inline or msg.nbytes <= self.config.inline_decode_bytes:
            tensor = decoder.decode(msg, buf)
        else:
            lock = self._decode_locks.setdefault(msg.kind, asyncio.Lock())
            async with lock:  # decoders keep per-example state: one message at a time, in order
                tensor = await asyncio.to_thread(decoder.decode, msg, buf)
        if tuple(tensor.shape) != msg.shape:
            raise ProtocolError(
                f"payload decodes to shape {list(tensor.shape)}, header says {list(msg.shape)}",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        self.inbox.put(msg.key, tensor)
        self._next_seq[stream_key] = msg.seq + 1
        await self._ack(conn, msg.seq)

    async def _ack(self, conn: Connection, seq: int) -> None:
        before = conn.bytes_sent
        await conn.send(ack_header(seq), timeout=self.config.stall_timeout_s)
        self.stats.control_bytes += conn.bytes_sent - before


def plain(exc: BaseException) -> str:
    """An error's message without the ``[CODE]`` suffix (the code travels in its own field)."""
    return Exception.__str__(exc)


def _is_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
