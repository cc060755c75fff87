"""A resend (seq below the next expected) is size-checked like any frame before the receiver buffers it.

Security finding of issue 9: the receiver used to skip ``check_message`` for such frames, so an
allocated neighbour could declare a multi-GiB message under an old seq and make the receiver
allocate it. The stream code runs for real on a ``socket.socketpair`` (as in test_streams.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc

import msgspec
import torch

from peerd.errors import ErrorCode
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import (
    KIND_ACK,
    KIND_ACT,
    KIND_NACK,
    Expectation,
    Hello,
    TensorMessage,
    control_header,
    part_header,
    raw_payload,
)
from peerd.pipeline.streams import Inbox, StreamConfig, StreamReceiver, StreamStats
from peerd.swarm.framing import DEFAULT_LIMITS
from peerd.swarm.transport import Connection, Traffic

UP = "upstream-peer"
SHAPE = (2, 4, 8)  # (B, T, C)
IDS = {s: [(10 * s, 10 * s + 1)] for s in range(5)}  # one micro-batch of 2 examples per step


def _expectation(step: int) -> Expectation:
    return Expectation(
        "job", KIND_ACT, 0, "none", "float32", SHAPE[1:], (step, step + 1),
        lambda s, mb: IDS[s][mb] if s in IDS and mb == 0 else None,
    )  # fmt: skip


async def _pair() -> tuple[StreamReceiver, Connection, asyncio.Task]:
    receiver = StreamReceiver(
        upstream=UP,
        downstream=None,
        expectations={KIND_ACT: _expectation},
        decoders={KIND_ACT: RawDecoder()},
        inbox=Inbox(0),
        stats=StreamStats(),
        config=StreamConfig(chunk_bytes=1024),
    )
    a, b = socket.socketpair()
    r1, w1 = await asyncio.open_connection(sock=a)
    r2, w2 = await asyncio.open_connection(sock=b)
    server = Connection(UP, "p", r2, w2, channel=None, limits=receiver.limits(), traffic=Traffic())
    client = Connection("me", "p", r1, w1, channel=None, limits=DEFAULT_LIMITS, traffic=Traffic())
    task = asyncio.create_task(receiver.handle(server))
    await client.send(control_header(Hello(0)))  # every stream opens by naming its epoch
    return receiver, client, task


async def _accept_seq0(receiver: StreamReceiver, client: Connection) -> TensorMessage:
    x = torch.ones(SHAPE)
    msg = TensorMessage(KIND_ACT, "job", 0, 0, 0, IDS[0][0], "none", SHAPE, "float32", 0, x.numel() * 4)
    await client.send(part_header(msg), raw_payload(x))
    reply, _ = await client.recv(timeout=5)
    assert reply["kind"] == KIND_ACK and reply["seq"] == 0
    assert torch.equal(await receiver.inbox.get(KIND_ACT, 0, 0, 5), x)
    return msg


async def _close(client: Connection, task: asyncio.Task) -> None:
    await client.close()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def test_a_resend_declaring_a_huge_message_is_nacked_before_anything_is_allocated():
    async def go():
        receiver, client, task = await _pair()
        msg = await _accept_seq0(receiver, client)
        # the same seq again, now claiming a 64 MiB payload in two parts
        huge = msgspec.structs.replace(msg, nbytes=64 << 20)
        tracemalloc.start()
        try:
            await client.send(part_header(huge, 0, 2, 0), bytes(16))
            reply, _ = await client.recv(timeout=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        await _close(client, task)
        return receiver, reply, peak

    receiver, reply, peak = asyncio.run(asyncio.wait_for(go(), 30))
    assert reply["kind"] == KIND_NACK and reply["code"] == ErrorCode.SHAPE_MISMATCH
    assert peak < 4 << 20, f"{peak} B traced while rejecting the frame"
    assert receiver.stats.rejected == {"SHAPE_MISMATCH": 1} and receiver.stats.duplicates == 0


def test_an_honest_resend_of_an_accepted_message_is_re_acked_after_its_step_passed():
    async def go():
        receiver, client, task = await _pair()
        msg = await _accept_seq0(receiver, client)
        receiver.inbox.advance(2)  # step 0 is over: its ids are no longer checkable
        await client.send(part_header(msg), raw_payload(torch.ones(SHAPE)))
        reply, _ = await client.recv(timeout=5)
        await _close(client, task)
        return receiver, reply

    receiver, reply = asyncio.run(asyncio.wait_for(go(), 30))
    assert reply["kind"] == KIND_ACK and reply["seq"] == 0
    assert receiver.stats.duplicates == 1 and not receiver.stats.rejected
