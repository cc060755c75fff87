"""The sending side of a pipeline stream: reliable, ordered delivery of one direction's messages to one neighbour.

One persistent connection per neighbour and direction (reopened only when there is something
to send). Messages are numbered; the receiver acks what it accepted and nacks what it
rejected; on a nack or a broken stream the sender goes back to the first unacknowledged
message and sends it and everything after it again (go-back-N: the receiver dropped them),
the same bytes as before, so AC-SGD buffers on both sides see the same sequence. Every
connection opens with ``pp.hello`` naming the sender's allocation epoch; a receiver that
refuses it as NOT_ALLOWED or STALE ends the sender (this peer is not, or no longer, its
neighbour: retrying cannot help). Budgets
(``max_resends`` per message, ``max_reconnects`` in a row) end in a typed error that wakes the
stage (``on_failure``) instead of a hang. Spec: protocols/pipeline-frames.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.pipeline.frames import (
    Abort,
    Ack,
    Control,
    Hello,
    Nack,
    TensorMessage,
    control_header,
    parse_control,
    part_header,
    part_spans,
)
from peerd.pipeline.streams import PeerRef, StreamConfig, StreamStats
from peerd.swarm.transport import Connection, Transport
from peerd.tasks import cancel_and_wait

logger = get_logger(__name__)

Tamper = Callable[[TensorMessage, int, list[tuple[dict, memoryview]]], list[tuple[dict, Any]]]
"""Test and debugging hook: (message, attempt, frames) -> the frames to send instead."""


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
        epoch: int = 0,
        ack_deadline: Callable[[], float] | None = None,
    ) -> None:
        self.transport = transport
        # how long the receiver may take to accept what was sent: the stage's learnt deadline
        # (``peerd.pipeline.deadlines``), else the configured ``ack_timeout_s``
        self.ack_deadline = ack_deadline or (lambda: config.ack_timeout_s)
        self.epoch = epoch
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
        deadline = self.ack_deadline()
        try:
            async with asyncio.timeout(deadline):
                while len(self._unacked) >= self.config.window and self._error is None:
                    await self._wait_change()
        except TimeoutError:
            raise PeerUnavailable(
                f"{self.peer} accepted nothing for {deadline:.3g} s", code=ErrorCode.TIMEOUT
            ) from None
        self._raise_if_failed()
        seq = self._seq
        self._seq += 1
        self._unacked[seq] = _Outgoing(_with_seq(msg, seq), view)
        self._changed.set()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until the receiver accepted every queued message."""
        timeout = self.ack_deadline() if timeout is None else timeout
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
            await conn.send(control_header(Abort(step, code, message)), timeout=2.0)

    async def close(self) -> None:
        for task in (self._pump, self._reader):
            await cancel_and_wait(task)
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
        before = conn.bytes_sent
        try:
            await conn.send(control_header(Hello(self.epoch)), timeout=self.config.stall_timeout_s)
        except PeerdError:
            await conn.close(timeout=0.1)
            raise
        self.stats.control_bytes += conn.bytes_sent - before
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
        counters.raw_bytes += math.prod(msg.shape) * 4  # counted with its frames, as they leave

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
            if exc.code in (ErrorCode.NOT_ALLOWED, ErrorCode.STALE):
                self._fail(exc)  # we are not (or no longer) this peer's neighbour: retrying cannot help
            elif conn is self._conn:
                await self._broken(exc)
        except PeerdError as exc:
            if conn is self._conn:
                await self._broken(exc)

    def _on_control(self, ctl: Control) -> None:
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
        elif isinstance(ctl, Abort):
            self._fail(ProtocolError(f"neighbour aborted step {ctl.step}: {ctl.message}", code=ctl.code))
        else:  # a hello travels from sender to receiver only
            raise ProtocolError(f"{self.peer} sent a hello on a stream it receives", code=ErrorCode.MALFORMED)
        self._changed.set()


def _with_seq(msg: TensorMessage, seq: int) -> TensorMessage:
    return msgspec.structs.replace(msg, seq=seq)
