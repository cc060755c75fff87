"""Hostile peers on pipeline and averaging streams, on real p2pd daemons: authenticated epochs, numeric sanity.

Epochs: the remote's libp2p peer id is checked against the allocation (a stranger is refused
NOT_ALLOWED before any frame is read) and the stream's opening hello must name this peer's
epoch (a neighbour still running a superseded allocation is refused STALE, one ahead of it
FROM_FUTURE). Every refusal is counted by reason; the current neighbour's traffic goes on.
Numbers: a member whose gradient contribution is absurdly large fails the step on the
others with ``PeerMisbehaved`` naming it (what the runner suspects), instead of being averaged in.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import P2P

from peerd.averaging import GroupAllReduce
from peerd.averaging.messages import hello
from peerd.errors import ErrorCode, PeerdError, PeerMisbehaved
from peerd.pipeline.codec import RawDecoder
from peerd.pipeline.frames import (
    KIND_ACT,
    Expectation,
    Hello,
    TensorMessage,
    control_header,
    part_header,
    raw_payload,
)
from peerd.pipeline.sender import StreamSender
from peerd.pipeline.streams import Inbox, StreamConfig, StreamReceiver, StreamStats, stage_protocol
from peerd.swarm.transport import Transport

pytestmark = pytest.mark.integration

JOB = "epochs"
SHAPE = (2, 4, 8)  # (B, T, C)
IDS = (3, 9)
CONFIG = StreamConfig(connect_timeout_s=10, recv_timeout_s=10, ack_timeout_s=10, max_reconnects=1)


class Peers:
    """Three p2pd daemons on one loop: the receiver, its committed neighbour, a stranger."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.p2ps: list[P2P] = []
        self.transports: list[Transport] = []

    def run(self, coro, timeout: float = 60.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def start(self, n: int) -> None:
        for _ in range(n):
            known = [m for p in self.p2ps for m in await p.get_visible_maddrs()]
            p2p = await P2P.create(initial_peers=known)
            self.p2ps.append(p2p)
            self.transports.append(Transport(p2p))

    async def stop(self) -> None:
        for t in reversed(self.transports):
            await t.close()
        for p in reversed(self.p2ps):
            await p.shutdown()


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    p = Peers()
    try:
        p.run(p.start(3), timeout=90)
        yield p
    finally:
        p.run(p.stop(), timeout=30)
        p.loop.close()


def _expect(step: int) -> Expectation:
    return Expectation(
        JOB,
        KIND_ACT,
        0,
        "none",
        "float32",
        SHAPE[1:],
        (step, step + 1),
        lambda s, mb: IDS if mb == 0 else None,
    )


def _act(step: int) -> tuple[TensorMessage, torch.Tensor]:
    x = torch.arange(float(torch.Size(SHAPE).numel())).view(SHAPE) + step
    return TensorMessage(KIND_ACT, JOB, step, 0, 0, IDS, "none", SHAPE, "float32", 0, x.numel() * 4), x


async def _deliver(sender: StreamSender, step: int) -> PeerdError | None:
    """Start ``sender``, send one message of ``step``, wait for its ack; the typed error if it failed."""
    msg, x = _act(step)
    try:
        await sender.start()
        await sender.send(msg, raw_payload(x))
        await sender.flush(timeout=15)
    except PeerdError as exc:
        return exc
    finally:
        await sender.close()
    return None


def test_pipeline_streams_take_only_the_current_epochs_neighbour(peers: Peers):
    me, neighbour, stranger = peers.transports
    protocol = stage_protocol(JOB, 1)
    stats = StreamStats()
    inbox = Inbox(0)

    async def go():
        receiver = StreamReceiver(
            upstream=neighbour.peer_id,
            downstream=None,
            expectations={KIND_ACT: _expect},
            decoders={KIND_ACT: RawDecoder()},
            inbox=inbox,
            stats=stats,
            config=CONFIG,
            epoch=2,
        )
        await receiver.serve(me, protocol)
        try:

            def sender(t: Transport, epoch: int) -> StreamSender:
                return StreamSender(t, me.peer_id, protocol, config=CONFIG, stats=StreamStats(), epoch=epoch)

            errors = {
                "stranger": await _deliver(sender(stranger, 2), 0),
                "previous epoch": await _deliver(sender(neighbour, 1), 0),
                "next epoch": await _deliver(sender(neighbour, 3), 0),
            }
            # a raw stream that skips the hello and sends data at once
            conn = await neighbour.connect(me.peer_id, protocol)
            msg, x = _act(0)
            await conn.send(part_header(msg), raw_payload(x))
            try:
                await conn.recv(timeout=10)
                errors["no hello"] = None
            except PeerdError as exc:
                errors["no hello"] = exc
            await conn.close()
            # the committed neighbour of this epoch is served as before
            errors["current"] = await _deliver(sender(neighbour, 2), 0)
            got = await inbox.get(KIND_ACT, 0, 0, timeout=10)
            return errors, got
        finally:
            await me.stop_serving(protocol)

    def counted_by(t: Transport) -> Counter[str]:
        return Counter({c.name: n for c, n in t.refusals.items()}) + Counter(
            {c.name: n for c, n in t.rejections.items()}
        )

    counted = counted_by(me)
    errors, got = peers.run(go())
    codes = {k: (v.code if v is not None else None) for k, v in errors.items()}
    assert codes == {
        "stranger": ErrorCode.NOT_ALLOWED,
        "previous epoch": ErrorCode.STALE,
        "next epoch": ErrorCode.PEER_UNAVAILABLE,  # FROM_FUTURE is retried, then the reconnect budget ends
        "no hello": ErrorCode.NOT_ALLOWED,
        "current": None,
    }
    assert torch.equal(got, _act(0)[1])
    assert stats.refused == {"stranger": 1, "stale_epoch": 1, "future_epoch": 2, "no_hello": 1}
    assert stats.rejected == {"NOT_ALLOWED": 2, "STALE": 1, "FROM_FUTURE": 2}
    assert stats.snapshot()["refused"] == dict(stats.refused)  # what the worker's reports carry
    # the daemon-wide counters (peerd status: refusals.streams before the handler, .handlers in it)
    assert counted_by(me) - counted == stats.rejected


def test_averaging_streams_take_only_the_current_epochs_members(peers: Peers):
    a, b, stranger = peers.transports
    members = [a.peer_id, b.peer_id]
    g_a = [torch.full((64,), 1.0), torch.full((3, 5), 2.0)]
    g_b = [torch.full((64,), 3.0), torch.full((3, 5), 6.0)]

    async def go():
        current_a = GroupAllReduce(a, members, key="epochs/s0", timeout=10, epoch=2)
        await current_a.start()
        out: dict[str, object] = {}
        try:
            # b still averaging for epoch 1 (a superseded allocation with the same members)
            stale_b = GroupAllReduce(b, members, key="epochs/s0", timeout=10, epoch=1)
            try:
                await stale_b.allreduce(0, g_b)
            except PeerdError as exc:
                out["previous epoch"] = exc.code
            await stale_b.close()
            # a stranger opening the group's protocol
            conn = await stranger.connect(a.peer_id, current_a.protocol)
            try:
                await conn.send(hello(current_a.digest, 2).header())
                await conn.recv(timeout=10)
            except PeerdError as exc:
                out["stranger"] = exc.code
            await conn.close()
            # the members of this epoch average as before
            current_b = GroupAllReduce(b, members, key="epochs/s0", timeout=10, epoch=2)
            try:
                out["mean"] = await asyncio.gather(current_a.allreduce(0, g_a), current_b.allreduce(0, g_b))
            finally:
                await current_b.close()
        finally:
            await current_a.close()
        return out, current_a.stats

    out, stats = peers.run(go())
    assert out["previous epoch"] == ErrorCode.STALE
    assert out["stranger"] == ErrorCode.NOT_ALLOWED
    for result in out["mean"]:  # type: ignore[union-attr]
        assert torch.equal(result[0], torch.full((64,), 2.0)) and torch.equal(
            result[1], torch.full((3, 5), 4.0)
        )
    assert stats.refused == {"stale_epoch": 1, "stranger": 1}
    assert stats.rejected == {"STALE": 1, "NOT_ALLOWED": 1}


def test_an_absurd_gradient_contribution_fails_the_step_naming_its_member(peers: Peers):
    a, b, _ = peers.transports
    members = [a.peer_id, b.peer_id]
    g_a = [torch.randn(300, generator=torch.Generator().manual_seed(1))]
    g_b = [torch.randn(300, generator=torch.Generator().manual_seed(2)) * 1e5]  # 1e5x a's norm

    async def go():
        groups = [GroupAllReduce(t, members, key="absurd/s0", timeout=10) for t in (a, b)]
        for grp in groups:
            await grp.start()
        try:
            results = await asyncio.gather(
                groups[0].allreduce(0, g_a), groups[1].allreduce(0, g_b), return_exceptions=True
            )
            # the next step, with sane gradients on both, goes through
            again = await asyncio.gather(groups[0].allreduce(1, g_a), groups[1].allreduce(1, g_a))
        finally:
            for grp in groups:
                await grp.close()
        return results, again, groups[0].stats

    (on_a, on_b), again, stats = peers.run(go())
    assert (
        isinstance(on_a, PeerMisbehaved)
        and on_a.peer == str(b.peer_id)
        and on_a.code == ErrorCode.OUT_OF_RANGE
    )
    assert isinstance(on_b, PeerdError) and on_b.code == ErrorCode.OUT_OF_RANGE  # a told b why
    assert stats.rejected == {"OUT_OF_RANGE": 1} and stats.failed == 1
    assert torch.equal(again[0][0], g_a[0]) and torch.equal(again[1][0], g_a[0])


def test_the_pipeline_hello_is_a_control_frame_with_the_epoch():
    assert control_header(Hello(7)) == {"kind": "pp.hello", "v": 1, "epoch": 7}


def test_an_averaging_frame_bigger_than_the_groups_share_is_refused_before_its_payload(peers: Peers):
    """A member may send what a share of the stage's gradients takes at fp32, not the transport's 1 GiB."""
    a, b, _ = peers.transports
    members = [a.peer_id, b.peer_id]
    g_a = [torch.full((64,), 1.0), torch.full((3, 5), 2.0)]
    g_b = [torch.full((64,), 3.0), torch.full((3, 5), 6.0)]
    numel = 64 + 15

    async def go():
        groups = [GroupAllReduce(t, members, key="bounded/s0", timeout=10) for t in (a, b)]
        for grp in groups:
            grp.max_numel = numel  # what the job runner sets: the stage's parameter count
            await grp.start()
        try:
            # b opens the group's stream as a member would, then announces a 1 MiB part
            conn = await b.connect(a.peer_id, groups[0].protocol)
            try:
                await conn.send(hello(groups[0].digest, 0).header())
                await conn.send({"kind": "avg.part"}, bytes(1 << 20))
                await conn.recv(timeout=10)
                refused = None
            except PeerdError as exc:
                refused = exc.code
            await conn.close()
            mean = await asyncio.gather(groups[0].allreduce(0, g_a), groups[1].allreduce(0, g_b))
        finally:
            for grp in groups:
                await grp.close()
        return refused, mean, groups[0].frame_limits()

    refused, mean, limits = peers.run(go())
    assert refused == ErrorCode.OVERSIZED
    assert limits is not None and limits.max_payload == 40 * 4 + 64 * 1024  # ceil(79 / 2) values
    for result in mean:  # the honest step fits the bound
        assert torch.equal(result[0], torch.full((64,), 2.0)) and torch.equal(
            result[1], torch.full((3, 5), 4.0)
        )
