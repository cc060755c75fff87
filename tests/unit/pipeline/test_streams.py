"""Pipeline streams over in-memory socket pairs: ordered delivery, parts, nack -> resend, failure, reconnect, inbox.

The connections are the real ``peerd.swarm.transport.Connection`` (framing, counters) on a
``socket.socketpair`` instead of a p2pd stream; tests/integration/test_pipeline_faults.py runs the
same paths over real p2pd daemons.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket

import pytest
import torch

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import KIND_ACT, Expectation, TensorMessage, raw_payload
from peerd.pipeline.sender import StreamSender
from peerd.pipeline.streams import (
    Inbox,
    StreamConfig,
    StreamReceiver,
    StreamStats,
    stage_protocol,
)
from peerd.swarm.framing import DEFAULT_LIMITS
from peerd.swarm.transport import Connection, Traffic

UP, ME = "upstream-peer", "this-stage"
T, C, MB = 4, 8, 2
IDS = {s: [[10 * s + 2 * m, 10 * s + 2 * m + 1] for m in range(3)] for s in range(10)}  # 3 micro-batches of 2


def expectation(step: int) -> Expectation:
    return Expectation(
        "job",
        KIND_ACT,
        0,
        "none",
        "float32",
        (T, C),
        (step, step + 1),
        lambda s, mb: IDS[s][mb] if s in IDS and 0 <= mb < 3 else None,
    )


class PipeTransport:
    """Opens socket pairs whose far end the receiver serves as if ``UP`` had opened a p2p stream."""

    def __init__(self, receiver: StreamReceiver) -> None:
        self.receiver = receiver
        self.server_conns: list[Connection] = []
        self.tasks: set[asyncio.Task] = set()
        self.connects = 0

    async def connect(self, peer, protocol, timeout=10.0) -> Connection:
        self.connects += 1
        a, b = socket.socketpair()
        r1, w1 = await asyncio.open_connection(sock=a)
        r2, w2 = await asyncio.open_connection(sock=b)
        server = Connection(
            UP, protocol, r2, w2, channel=None, limits=self.receiver.limits(), traffic=Traffic()
        )
        self.server_conns.append(server)
        task = asyncio.create_task(self._serve(server))
        self.tasks.add(task)
        return Connection(peer, protocol, r1, w1, channel=None, limits=DEFAULT_LIMITS, traffic=Traffic())

    async def _serve(self, conn: Connection) -> None:  # what Transport._handle_stream does
        try:
            await self.receiver.handle(conn)
        except PeerdError as exc:
            with contextlib.suppress(PeerdError):
                await conn.send_error(exc.code, str(exc))
        finally:
            await conn.close()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for c in self.server_conns:
            await c.close()


class Pair:
    def __init__(self, **config) -> None:
        self.config = StreamConfig(**{"chunk_bytes": 1024, "recv_timeout_s": 5, "ack_timeout_s": 5, **config})
        self.inbox = Inbox(0)
        self.rx_stats, self.tx_stats = StreamStats(), StreamStats()
        self.failures: list[PeerdError] = []
        self.receiver = StreamReceiver(
            upstream=UP,
            downstream=None,
            expectations={KIND_ACT: expectation},
            decoders={KIND_ACT: RawDecoder()},
            inbox=self.inbox,
            stats=self.rx_stats,
            config=self.config,
        )
        self.transport = PipeTransport(self.receiver)
        self.sender = StreamSender(
            self.transport,  # type: ignore[arg-type]
            ME,
            stage_protocol("job", 1),
            config=self.config,
            stats=self.tx_stats,
            on_failure=self.on_failure,
        )

    def on_failure(self, exc: PeerdError) -> None:
        self.failures.append(exc)
        self.inbox.fail(exc)

    async def send(self, step: int, mb: int, x: torch.Tensor) -> None:
        ids = IDS[step][mb]
        payload = raw_payload(x)
        msg = TensorMessage(
            KIND_ACT, "job", step, mb, 0, tuple(ids), "none", tuple(x.shape), "float32", 0, payload.nbytes
        )
        await self.sender.send(msg, payload)

    async def close(self) -> None:
        await self.sender.close()
        await self.transport.close()


def acts(step: int, mb: int) -> torch.Tensor:
    return torch.full((MB, T, C), float(100 * step + mb)) + torch.arange(T * C, dtype=torch.float32).view(
        T, C
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_messages_arrive_in_order_in_parts_and_are_counted_on_both_sides():
    async def go():
        pair = Pair(chunk_bytes=100)  # 256-byte tensors travel as 3 parts
        await pair.sender.start()
        for mb in range(3):
            await pair.send(0, mb, acts(0, mb))
        got = [await pair.inbox.get(KIND_ACT, 0, mb, 5) for mb in range(3)]
        await pair.sender.flush()
        await pair.close()
        return pair, got

    pair, got = run(go())
    for mb, t in enumerate(got):
        assert torch.equal(t, acts(0, mb))
    sent, received = pair.tx_stats.sent[(0, "fwd")], pair.rx_stats.received[(0, "fwd")]
    assert sent.messages == received.messages == 3 and sent.frames == received.frames == 9
    assert sent.wire_bytes == received.wire_bytes > 3 * 256
    assert pair.tx_stats.control_bytes == pair.rx_stats.control_bytes > 0  # the acks
    assert not pair.rx_stats.rejected and pair.tx_stats.resends == 0


def test_a_rejected_frame_is_counted_nacked_and_resent_with_what_followed_it():
    def tamper(msg: TensorMessage, attempt: int, frames):
        if msg.seq == 1 and attempt == 1:
            header, payload = frames[0]
            return [({**header, "step": 7}, payload)]  # wrong step, first attempt only
        return frames

    async def go():
        pair = Pair()
        await pair.sender.start()
        pair.sender.tamper = tamper
        for mb in range(3):
            await pair.send(0, mb, acts(0, mb))
        got = [await pair.inbox.get(KIND_ACT, 0, mb, 5) for mb in range(3)]
        await pair.sender.flush()
        await pair.close()
        return pair, got

    pair, got = run(go())
    assert [float(t[0, 0, 0]) for t in got] == [0.0, 1.0, 2.0]
    assert dict(pair.rx_stats.rejected) == {"WRONG_STEP": 1}
    assert pair.tx_stats.resends >= 1 and not pair.failures


def test_a_message_rejected_every_time_fails_the_sender_with_the_receivers_code():
    def tamper(msg, attempt, frames):
        header, payload = frames[0]
        return [({**header, "ids": [999, 998]}, payload)]

    async def go():
        pair = Pair(max_resends=2)
        await pair.sender.start()
        pair.sender.tamper = tamper
        await pair.send(0, 0, acts(0, 0))
        with pytest.raises(ProtocolError) as info:
            await pair.sender.flush()
        with pytest.raises(ProtocolError):
            await pair.inbox.get(KIND_ACT, 0, 0, 5)  # the stage's waits wake up with the error
        await pair.close()
        return pair, info.value

    pair, error = run(go())
    assert error.code == ErrorCode.UNKNOWN_EXAMPLE
    assert pair.rx_stats.rejected["UNKNOWN_EXAMPLE"] == 3  # first try + 2 resends
    assert len(pair.failures) == 1


def test_a_broken_stream_is_reopened_and_unacked_messages_resent_once():
    async def go():
        pair = Pair()
        await pair.sender.start()
        await pair.send(0, 0, acts(0, 0))
        await pair.sender.flush()
        # the receiver's side of the stream dies (e.g. p2pd restarted the connection)
        await pair.transport.server_conns[0].close()
        await pair.send(0, 1, acts(0, 1))
        await pair.send(0, 2, acts(0, 2))
        got = [await pair.inbox.get(KIND_ACT, 0, mb, 5) for mb in range(3)]
        await pair.sender.flush()
        await pair.close()
        return pair, got

    pair, got = run(go())
    assert [float(t[0, 0, 0]) for t in got] == [0.0, 1.0, 2.0]
    assert pair.transport.connects == 2 and pair.tx_stats.reconnects == 1


def test_an_abort_from_the_neighbour_fails_the_waiting_stage_at_once():
    async def go():
        pair = Pair()
        await pair.sender.start()
        waiter = asyncio.create_task(pair.inbox.get(KIND_ACT, 0, 1, 20))
        await pair.sender.abort(0, ErrorCode.SHAPE_MISMATCH, "bad stage")
        with pytest.raises(ProtocolError) as info:
            await waiter
        await pair.close()
        return info.value

    assert run(go()).code == ErrorCode.SHAPE_MISMATCH


def test_inbox_times_out_typed_accepts_early_frames_and_forgets_old_steps():
    async def go():
        inbox = Inbox(3)
        with pytest.raises(PeerUnavailable) as info:
            await inbox.get(KIND_ACT, 3, 0, 0.05)
        assert info.value.code == ErrorCode.TIMEOUT
        inbox.put((KIND_ACT, 4, 0), torch.ones(1))  # next step, early
        inbox.put((KIND_ACT, 3, 1), torch.zeros(1))
        with pytest.raises(ProtocolError):
            inbox.put((KIND_ACT, 3, 1), torch.zeros(1))
        inbox.advance(4)  # step 3 is over: its leftovers go
        assert torch.equal(await inbox.get(KIND_ACT, 4, 0, 1), torch.ones(1))
        with pytest.raises(PeerUnavailable):
            await inbox.get(KIND_ACT, 3, 1, 0.05)
        inbox.fail(ProtocolError("gone", code=ErrorCode.WRONG_STEP))
        with pytest.raises(ProtocolError):
            await inbox.get(KIND_ACT, 4, 1, 1)

    run(go())


class RecordingDecoder(RawDecoder):
    """A stand-in for the AC-SGD decoder: stateful, and it records which steps it decoded."""

    stateful = True

    def __init__(self) -> None:
        self.steps: list[int] = []

    def decode(self, msg, payload):
        self.steps.append(msg.step)
        return super().decode(msg, payload)


def test_a_held_inbox_keeps_stateful_decoders_from_running_a_step_ahead():
    async def go():
        pair = Pair()
        decoder = RecordingDecoder()
        pair.receiver.decoders[KIND_ACT] = decoder
        pair.inbox.hold(True)  # this stage checkpoints after step 0
        await pair.sender.start()
        await pair.send(0, 0, acts(0, 0))
        await pair.send(1, 0, acts(1, 0))  # the upstream stage already runs step 1
        assert torch.equal(await pair.inbox.get(KIND_ACT, 0, 0, 5), acts(0, 0))
        with pytest.raises(PeerUnavailable):
            await pair.inbox.get(KIND_ACT, 1, 0, 0.3)
        assert decoder.steps == [0]  # step 1 is received but not applied: the buffers are step 0's
        pair.inbox.advance(1)  # after the checkpoint
        assert torch.equal(await pair.inbox.get(KIND_ACT, 1, 0, 5), acts(1, 0))
        assert decoder.steps == [0, 1]
        pair.inbox.hold(False)
        await pair.send(2, 0, acts(2, 0))  # not held: decoded while this stage is still in step 1
        await pair.sender.flush()
        assert decoder.steps == [0, 1, 2]
        await pair.close()

    run(go())


def test_stream_config_validation():
    StreamConfig().validate()
    for bad in (dict(chunk_bytes=10), dict(recv_timeout_s=0), dict(window=0), dict(max_resends=-1)):
        with pytest.raises(PeerdError):
            dataclasses.replace(StreamConfig(), **bad).validate()
