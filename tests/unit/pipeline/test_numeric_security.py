"""Numeric sanity on pipeline streams: NaN/Inf and absurd values from a neighbour fail the step, naming the peer.

``NumericGuard`` by itself, then the receiver on a real ``socket.socketpair`` stream (as in
test_streams_resend_bounds.py): the sender is nacked with the code, the stage's inbox fails
with ``PeerMisbehaved`` naming the sender, and nothing reaches the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket

import pytest
import torch

from peerd.errors import ConfigError, ErrorCode, PeerMisbehaved
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
from peerd.pipeline.sanity import NumericGuard, SanityConfig, magnitude
from peerd.pipeline.streams import Inbox, StreamConfig, StreamReceiver, StreamStats
from peerd.swarm.framing import DEFAULT_LIMITS
from peerd.swarm.transport import Connection, Traffic

UP = "upstream-peer"
SHAPE = (2, 4, 8)  # (B, T, C)


def _guard(**kw) -> NumericGuard:
    return NumericGuard(SanityConfig(**kw))


def test_magnitude_is_max_abs_and_rms_and_propagates_nan():
    t = torch.tensor([3.0, -4.0])
    assert magnitude(t) == (4.0, math.sqrt(12.5))
    assert magnitude(t.to(torch.bfloat16))[0] == 4.0
    assert math.isnan(magnitude(torch.tensor([1.0, math.nan]))[0])
    assert magnitude(torch.tensor([1.0, -math.inf]))[0] == math.inf


@pytest.mark.parametrize(
    "value, code",
    [(math.nan, ErrorCode.NON_FINITE), (math.inf, ErrorCode.NON_FINITE), (1e30, ErrorCode.OUT_OF_RANGE)],
)
def test_the_guard_refuses_non_finite_and_huge_values_naming_the_peer(value, code):
    t = torch.randn(4, 8)
    t[1, 2] = value
    with pytest.raises(PeerMisbehaved) as info:
        _guard().check(KIND_ACT, t, peer="P", what="acts")
    assert info.value.code == code and info.value.peer == "P" and "from P" in info.value.message


def test_the_relative_bound_starts_after_warmup_and_follows_the_recent_median():
    g = _guard(rms_ratio=100.0, warmup=4, window=8)
    base = torch.randn(64)
    g.check(KIND_ACT, base * 1e4, peer="P", what="acts")  # before warm-up any scale is accepted
    for _ in range(4):
        g.check(KIND_ACT, base, peer="P", what="acts")
    g.check(KIND_ACT, base * 50, peer="P", what="acts")  # within 100x of the median
    with pytest.raises(PeerMisbehaved) as info:
        g.check(KIND_ACT, base * 1000, peer="P", what="acts")
    assert info.value.code == ErrorCode.OUT_OF_RANGE and "median" in info.value.message
    g.check("pp.grad", base * 1000, peer="P", what="grads")  # kinds keep separate scales
    g.reset()
    g.check(KIND_ACT, base * 1000, peer="P", what="acts")


def test_bad_sanity_settings_are_config_errors():
    for kw in ({"max_abs": 0.5}, {"rms_ratio": math.inf}, {"warmup": 9, "window": 8}):
        with pytest.raises(ConfigError):
            SanityConfig(**kw).validate()


def _expectation(step: int) -> Expectation:
    return Expectation(
        "job",
        KIND_ACT,
        0,
        "none",
        "float32",
        SHAPE[1:],
        (step, step + 1),
        lambda s, mb: (1, 2) if mb == 0 else None,
    )


async def _send(x: torch.Tensor) -> tuple[dict, StreamReceiver, BaseException | torch.Tensor]:
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
    await client.send(control_header(Hello(0)))
    msg = TensorMessage(KIND_ACT, "job", 0, 0, 0, (1, 2), "none", SHAPE, "float32", 0, x.numel() * 4)
    await client.send(part_header(msg), raw_payload(x))
    reply, _ = await client.recv(timeout=5)
    try:
        got: BaseException | torch.Tensor = await receiver.inbox.get(KIND_ACT, 0, 0, 5)
    except Exception as exc:
        got = exc
    await client.close()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return reply, receiver, got


@pytest.mark.parametrize(
    "value, code", [(math.nan, "NON_FINITE"), (-math.inf, "NON_FINITE"), (3e7, "OUT_OF_RANGE")]
)
def test_a_neighbours_bad_activations_fail_the_step_and_name_it(value, code):
    x = torch.randn(SHAPE)
    x[1, 3, 5] = value
    reply, receiver, got = asyncio.run(asyncio.wait_for(_send(x), 30))
    assert reply["kind"] == KIND_NACK and ErrorCode(reply["code"]).name == code
    assert isinstance(got, PeerMisbehaved) and got.peer == UP and got.code.name == code
    assert receiver.inbox.error is got and receiver.stats.rejected == {code: 1}


def test_sane_activations_pass():
    x = torch.randn(SHAPE)
    reply, receiver, got = asyncio.run(asyncio.wait_for(_send(x), 30))
    assert reply["kind"] == KIND_ACK and isinstance(got, torch.Tensor) and torch.equal(got, x)
    assert not receiver.stats.rejected
