"""Activation/gradient streams between allocated pipeline neighbours: the receiving side and shared parts.

Each stage serves one protocol (``stage_protocol``) that only its allocated upstream and
downstream peers may open: the remote's libp2p peer id is checked against the allocation
(others get NOT_ALLOWED from the Transport), and the stream's first frame, ``pp.hello``, must
name this receiver's allocation epoch (an older one is STALE, a newer one FROM_FUTURE), so a
neighbour still running a superseded allocation cannot feed this one; refusals are counted
by reason in ``StreamStats.refused``. ``StreamReceiver`` validates every frame against what the stage expects (``frames.check_message``), decodes
accepted messages strictly in sequence order (AC-SGD buffers must see the same sequence as
the sender's), puts them into the stage's ``Inbox`` and acks them; a rejected frame gets a
nack with its ErrorCode and is counted. ``peerd.pipeline.sender`` is the other end. Every
wait has a timeout, so a dead or misbehaving neighbour ends in a typed error, never a hung
pipeline. ``StreamStats`` counts wire bytes per (boundary, direction), rejections per error
code, resends and reconnects. Spec: protocols/pipeline-frames.md.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import torch

from peerd.errors import (
    CodecError,
    ConfigError,
    ErrorCode,
    PeerdError,
    PeerMisbehaved,
    PeerUnavailable,
    ProtocolError,
)
from peerd.log import get_logger
from peerd.pipeline.deadlines import DeadlineConfig
from peerd.pipeline.frames import (
    BACKWARD_KINDS,
    FORWARD_KINDS,
    KIND_ABORT,
    KIND_ACT,
    KIND_GRAD,
    KIND_HELLO,
    KIND_VAL,
    Abort,
    Ack,
    Assembler,
    Expectation,
    Hello,
    Nack,
    TensorMessage,
    check_epoch,
    check_message,
    control_header,
    parse_control,
    parse_part,
)
from peerd.pipeline.sanity import NumericGuard, SanityConfig
from peerd.swarm.framing import FrameLimits, StreamClosed
from peerd.swarm.transport import Connection, Transport

logger = get_logger(__name__)

PeerRef = Hashable  # a hivemind PeerID, passed through opaquely (this layer does not import hivemind)


class MessageDecoder(Protocol):
    """Turns an accepted message's payload into its tensor (``peerd.pipeline.codec`` decoders)."""

    inline: bool  # always cheap enough for the event loop (else only small messages are decoded there)

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor: ...


def stage_protocol(job: str, stage: int) -> str:
    """The protocol stage ``stage`` of job ``job`` serves (its neighbours open it)."""
    return f"peerd/pp/1/{job}/s{stage}"


def direction(kind: str) -> str:
    return "fwd" if kind in FORWARD_KINDS else "bwd"


def traffic(kind: str) -> str:
    """What a kind's bytes count as: ``fwd`` / ``bwd`` by direction, but ``val`` for held-out
    activations (they travel forward on the same stream; apart, they leave compression ratios
    and per-step training traffic alone)."""
    return "val" if kind == KIND_VAL else direction(kind)


@dataclass(frozen=True)
class StreamConfig:
    """Sizes, deadlines and retry budgets of the pipeline streams."""

    chunk_bytes: int = 4 << 20
    """Largest payload of one frame; bigger messages travel as several parts."""
    connect_timeout_s: float = 20.0
    """Deadline to open a stream to a neighbour (the Transport retries within it)."""
    recv_timeout_s: float = 120.0
    """How long a stage waits for a neighbour's message (covers its compute and averaging) in an
    epoch's first steps; then the wait follows the observed step times (``deadlines``)."""
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    """How the wait for a neighbour's message adapts to the step times (``peerd.pipeline.deadlines``)."""
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
    sanity: SanityConfig = field(default_factory=SanityConfig)
    """Bounds on received activation and gradient values (``peerd.pipeline.sanity``)."""

    def validate(self) -> None:
        self.sanity.validate()
        self.deadlines.validate()
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
    raw_bytes: int = 0  # sent: what the messages' tensors hold as fp32 (the compression ratio's numerator)
    messages: int = 0
    frames: int = 0


@dataclass
class StreamStats:
    """Counters of one stage's streams (both its sender and its receiver side)."""

    sent: dict[tuple[int, str], LinkCounters] = field(default_factory=dict)
    received: dict[tuple[int, str], LinkCounters] = field(default_factory=dict)
    control_bytes: int = 0  # acks/nacks/aborts/hellos sent and received
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    """Frames and streams refused, by ErrorCode name."""
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    """Streams refused at their opening, by reason: ``stranger`` (not a neighbour of this epoch),
    ``stale_epoch``, ``future_epoch``, ``no_hello`` (data before the epoch was named)."""
    resends: int = 0
    reconnects: int = 0
    duplicates: int = 0
    out_of_order: int = 0

    def link(self, side: str, boundary: int, kind: str) -> LinkCounters:
        table = self.sent if side == "sent" else self.received
        return table.setdefault((boundary, traffic(kind)), LinkCounters())

    def reject(self, code: ErrorCode) -> None:
        self.rejected[code.name] += 1

    def refuse(self, reason: str, code: ErrorCode) -> None:
        self.refused[reason] += 1
        self.reject(code)

    def wire_bytes(self) -> dict[str, int]:
        """``{"b0.fwd.sent": n, ...}``: wire bytes per boundary, traffic (``fwd``, ``bwd``, ``val``) and side."""
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
            "refused": dict(self.refused),
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
        self._hold = False
        self._moved = asyncio.Event()

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

    def hold(self, on: bool) -> None:
        """While on, stateful decoders (AC-SGD buffers) wait with messages of later steps until ``advance``.

        A stage sets it for a step it will checkpoint after: its receiving buffers must then be
        those of the steps so far, exactly as the sender's are, not already a step ahead.
        """
        self._hold = on
        self._moved.set()

    async def decodable(self, step: int) -> None:
        """Return when a stateful decoder may apply a message of ``step`` (at once unless held)."""
        while self._hold and step > self.step and self._error is None:
            self._moved.clear()
            await self._moved.wait()

    def advance(self, step: int) -> None:
        """Start step ``step``: frames for ``step`` and ``step + 1`` are accepted from now on."""
        self.step = step
        self._moved.set()
        for key in [k for k in self._slots if k[1] < step]:
            fut = self._slots.pop(key)
            if not fut.done():
                fut.cancel()

    def fail(self, exc: PeerdError) -> None:
        """Wake every waiter with ``exc`` (a stream failed, a neighbour aborted)."""
        if self._error is None:
            self._error = exc
        self._moved.set()
        for fut in self._slots.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved here: a slot nobody waits on must not log "never retrieved"


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
        epoch: int = 0,
    ) -> None:
        self.epoch = epoch  # the allocation epoch whose neighbours are upstream/downstream
        self.upstream = upstream
        self.downstream = downstream
        self.expectations = expectations  # kind -> (current step) -> Expectation
        self.decoders = decoders
        self.inbox = inbox
        self.stats = stats
        self.config = config
        self._next_seq: dict[tuple[PeerRef, str], int] = {}
        self._decode_locks: dict[str, asyncio.Lock] = {}
        self.guard = NumericGuard(config.sanity)

    def allowed(self, peer: PeerRef) -> bool:
        """The Transport's gate: only this epoch's committed neighbours may open the stream."""
        if peer is not None and peer in (self.upstream, self.downstream):
            return True
        self.stats.refuse("stranger", ErrorCode.NOT_ALLOWED)
        logger.info("refused a pipeline stream from %s: not a neighbour in epoch %d", peer, self.epoch)
        return False

    def limits(self) -> FrameLimits:
        return FrameLimits(max_payload=self.config.chunk_bytes)

    async def serve(self, transport: Transport, protocol: str) -> None:
        await transport.serve(protocol, self.handle, allowed=self.allowed, limits=self.limits())

    async def handle(self, conn: Connection) -> None:
        """One neighbour's stream: runs until it closes; out-of-sync bytes end it with a typed error."""
        assembler = Assembler()
        admitted = False  # until the stream's pp.hello named this receiver's epoch
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
            if not admitted:
                self.stats.control_bytes += wire
                self._admit(conn, header)  # raises: the Transport sends its code and closes the stream
                admitted = True
                continue
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
                await conn.send(
                    control_header(Nack(seq if _is_seq(seq) else -1, exc.code, exc.message)),
                    timeout=5.0,
                )

    def _admit(self, conn: Connection, header: dict) -> None:
        """Check the stream's opening ``pp.hello`` against this receiver's epoch; count and raise if refused."""
        if header.get("kind") != KIND_HELLO:
            self.stats.refuse("no_hello", ErrorCode.NOT_ALLOWED)
            raise ProtocolError(
                f"a pipeline stream must open with {KIND_HELLO}, got {header.get('kind')!r}",
                code=ErrorCode.NOT_ALLOWED,
            )
        try:
            hello = parse_control(header)
            assert isinstance(hello, Hello)
            check_epoch(hello.epoch, self.epoch, f"stream from {conn.peer_id}")
        except ProtocolError as exc:
            reason = {ErrorCode.STALE: "stale_epoch", ErrorCode.FROM_FUTURE: "future_epoch"}.get(exc.code)
            if reason is None:
                self.stats.reject(exc.code)
            else:
                self.stats.refuse(reason, exc.code)
            logger.info("refused a pipeline stream from %s: %s", conn.peer_id, exc)
            raise

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
        kinds = set(FORWARD_KINDS) if conn.peer_id == self.upstream else set()
        if conn.peer_id == self.downstream:
            kinds.update(BACKWARD_KINDS)
        if msg.kind not in kinds or msg.kind not in self.expectations:
            raise ProtocolError(
                f"{msg.kind} frames must come from the "
                f"{'upstream' if msg.kind in FORWARD_KINDS else 'downstream'} neighbour"
                + ("" if msg.kind in self.expectations else ", and this stage takes none"),
                code=ErrorCode.NOT_ALLOWED,
            )
        # one sender per neighbour numbers all its kinds in one sequence
        stream_key = (conn.peer_id, direction(msg.kind))
        expected_seq = self._next_seq.get(stream_key, 0)
        duplicate = msg.seq < expected_seq
        if part.index == 0:  # later parts must repeat this metadata (the assembler checks)
            check_message(msg, self.expectations[msg.kind](self.inbox.step), accepted=duplicate)
        counters = self.stats.link("received", msg.boundary, msg.kind)
        counters.wire_bytes += wire
        counters.payload_bytes += len(payload)
        counters.frames += 1
        done = assembler.feed(part, payload, keep=not duplicate)
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
        if getattr(decoder, "stateful", False):
            await self.inbox.decodable(msg.step)
        peer = str(conn.peer_id)
        try:
            if decoder.inline or msg.nbytes <= self.config.inline_decode_bytes:
                tensor = self._decode(decoder, msg, buf, peer)
            else:
                lock = self._decode_locks.setdefault(msg.kind, asyncio.Lock())
                async with lock:  # decoders keep per-example state: one message at a time, in order
                    tensor = await asyncio.to_thread(self._decode, decoder, msg, buf, peer)
        except PeerMisbehaved as exc:  # the same bytes again cannot help: fail the step, suspect the peer
            logger.warning(
                "refusing %s: failing step %d and suspecting %s", exc.message, self.inbox.step, peer
            )
            self.inbox.fail(exc)
            raise
        self.inbox.put(msg.key, tensor)
        self._next_seq[stream_key] = msg.seq + 1
        await self._ack(conn, msg.seq)

    def _decode(self, decoder: MessageDecoder, msg: TensorMessage, buf: bytearray, peer: str) -> torch.Tensor:
        """Decode, then check shape and numeric sanity (after decompression, before the stage sees it)."""
        what = f"{msg.kind} of step {msg.step} micro-batch {msg.mb}"
        try:
            tensor = decoder.decode(msg, buf)
        except PeerdError as exc:
            if exc.code != ErrorCode.NON_FINITE:
                raise
            raise PeerMisbehaved(f"{what} from {peer} holds NaN or Inf", peer=peer, code=exc.code) from exc
        if tuple(tensor.shape) != msg.shape:
            raise ProtocolError(
                f"payload decodes to shape {list(tensor.shape)}, header says {list(msg.shape)}",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        if msg.kind in (
            KIND_ACT,
            KIND_GRAD,
            KIND_VAL,
        ):  # norm frames are float64 sums: the decoder checked them finite
            self.guard.check(msg.kind, tensor, peer=peer, what=what)
        return tensor

    async def _ack(self, conn: Connection, seq: int) -> None:
        before = conn.bytes_sent
        await conn.send(control_header(Ack(seq)), timeout=self.config.stall_timeout_s)
        self.stats.control_bytes += conn.bytes_sent - before


def _is_seq(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
