"""GroupAllReduce over real p2pd daemons on loopback: exact and compressed means, refusals, bad frames, lost members."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import P2P

from peerd.averaging import GroupAllReduce, MemberMath, simulate
from peerd.averaging import allreduce as allreduce_module
from peerd.averaging.codec import build_codec, parse_compressor
from peerd.averaging.messages import KIND_PART, AvgMessage, hello
from peerd.averaging.partition import flatten, layout_of
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.swarm.transport import Transport

pytestmark = pytest.mark.integration

SHAPES = [(256, 65), (65,), (17, 5, 3), (1,)]  # 16 961 elements


class Cluster:
    """Five p2pd daemons on one event loop (four members and an outsider), a Transport each."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.p2ps: list[P2P] = []
        self.transports: list[Transport] = []

    def run(self, coro, timeout: float = 30.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def new_peer(self) -> tuple[P2P, Transport]:
        known = [m for p in self.p2ps for m in await p.get_visible_maddrs()]
        p2p = await P2P.create(initial_peers=known)  # connected to every earlier peer: a full mesh
        self.p2ps.append(p2p)
        transport = Transport(p2p)
        self.transports.append(transport)
        return p2p, transport

    async def start(self, n: int) -> None:
        for _ in range(n):
            await self.new_peer()

    async def stop(self) -> None:
        for transport in reversed(self.transports):
            await transport.close()
        for p2p in reversed(self.p2ps):
            await p2p.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.run(c.start(5), timeout=90)
        yield c
    finally:
        c.run(c.stop(), timeout=30)
        c.loop.close()


def grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * (1 + seed % 3) for s in SHAPES]


def rank_order_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc += t
    return acc / len(tensors)


def make_group(cluster: Cluster, size: int, key: str, **kwargs) -> list[GroupAllReduce]:
    members = cluster.transports[:size]
    ids = [t.peer_id for t in members]
    return [GroupAllReduce(t, ids, key=key, **kwargs) for t in members]


async def steps(avgs: list[GroupAllReduce], inputs: list[list[list[torch.Tensor]]], first: int = 0):
    """Run ``len(inputs)`` steps on every member concurrently; inputs[step][rank] is a gradient list."""
    for a in avgs:
        await a.start()
    try:
        return [
            await asyncio.gather(*(a.allreduce(first + s, g) for a, g in zip(avgs, per_rank, strict=True)))
            for s, per_rank in enumerate(inputs)
        ]
    finally:
        for a in avgs:
            await a.close()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_uncompressed_mean_is_exact_and_identical_on_every_member(cluster: Cluster, size: int):
    avgs = make_group(cluster, size, f"exact-{size}", timeout=10)
    inputs = [[grads(10 * s + r) for r in range(size)] for s in range(2)]
    outputs = cluster.run(steps(avgs, inputs))
    for per_rank_in, per_rank_out in zip(inputs, outputs, strict=True):
        for k in range(len(SHAPES)):
            expect = rank_order_mean([g[k] for g in per_rank_in])
            for out in per_rank_out:
                assert out[k].shape == SHAPES[k]
                assert torch.equal(out[k], expect)  # fp32 bit for bit, on every member
            torch.testing.assert_close(expect, torch.stack([g[k] for g in per_rank_in]).mean(0))
    numel = sum(math.prod(s) for s in SHAPES)
    for a in avgs:  # reduce-scatter + all-gather: 2 (D-1)/D of the fp32 bytes each way
        ideal = 2 * 2 * (size - 1) / size * 4 * numel
        assert ideal <= a.stats.bytes_sent <= 1.03 * ideal
        assert ideal <= a.stats.bytes_received <= 1.03 * ideal
        assert a.stats.steps == 2 and a.stats.failed == 0 and not a.stats.rejected
        assert (
            a.stats.raw_bytes_sent <= a.stats.bytes_sent
        )  # the frames hold what they stand for, plus headers
    # per step, every member sends each other member's part and its own share to every other: 2 (D-1) numel
    assert sum(a.stats.raw_bytes_sent for a in avgs) == 2 * 2 * (size - 1) * numel * 4


def test_the_wait_for_a_late_member_is_counted_apart_from_the_exchange(cluster: Cluster):
    """Rank 2 calls 0.3 s after the others: they count about that as waiting, it counts almost none."""
    avgs = make_group(cluster, 3, "late", timeout=10)

    async def late(a: GroupAllReduce, g: list[torch.Tensor], delay: float) -> list[torch.Tensor]:
        await asyncio.sleep(delay)
        return await a.allreduce(0, g)

    async def run() -> None:
        for a in avgs:
            await a.start()
        try:
            await asyncio.gather(*(late(a, grads(r), 0.3 if r == 2 else 0.0) for r, a in enumerate(avgs)))
        finally:
            for a in avgs:
                await a.close()

    cluster.run(run())
    for a in avgs[:2]:
        assert 0.25 < a.stats.waited_s <= a.stats.last_step_s
    assert avgs[2].stats.waited_s < 0.1 < 0.25 < avgs[0].stats.last_step_s


@pytest.mark.parametrize("compressor", [None, "q8"])
def test_large_gradients_take_the_worker_thread_path_with_the_same_result(
    cluster: Cluster, monkeypatch, compressor: str | None
):
    inputs = [[grads(70 + 10 * s + r) for r in range(3)] for s in range(2)]
    results = {}
    for inline in (True, False):  # the same arithmetic on the loop and in worker threads
        monkeypatch.setattr(allreduce_module, "INLINE_NUMEL", 1 << 30 if inline else 0)
        avgs = make_group(cluster, 3, f"path-{inline}-{compressor}", timeout=10, compressor=compressor)
        results[inline] = cluster.run(steps(avgs, inputs))
    for a, b in zip(results[True], results[False], strict=True):
        for out_a, out_b in zip(a, b, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True))


@pytest.mark.parametrize(("size", "compressor", "bits"), [(3, "q8", 8), (4, "q4", 4)])
def test_compressed_mean_matches_the_reference_and_the_quantizer_bound(
    cluster: Cluster, size: int, compressor: str, bits: int
):
    avgs = make_group(cluster, size, f"q-{size}", timeout=10, compressor=compressor)
    inputs = [[grads(100 + 10 * s + r) for r in range(size)] for s in range(2)]
    outputs = cluster.run(steps(avgs, inputs))
    maths = [MemberMath(r, size, parse_compressor(compressor)) for r in range(size)]
    for per_rank_in, per_rank_out in zip(inputs, outputs, strict=True):
        flats = [flatten(g) for g in per_rank_in]
        reference = simulate(maths, flats)[0]  # same arithmetic, residuals included, no network
        for out in per_rank_out:
            assert torch.equal(flatten(out), reference)
        peak = max(float(f.abs().max()) for f in flats)
        true = torch.stack(flats).mean(0)
        # first step: one sender and one reducer quantization, each <= absmax / 2**bits;
        # second step: the residuals add at most as much again
        assert float((reference - true).abs().max()) <= 1.02 * 4 * peak / 2**bits
    raw = 2 * 2 * (size - 1) / size * 4 * sum(math.prod(s) for s in SHAPES)
    for a in avgs:
        assert a.stats.bytes_sent < raw * (bits + 0.5) / 32  # codes, bf16 scales, frame headers
    # the fp32 the codes stand for, whatever their width
    assert sum(a.stats.raw_bytes_sent for a in avgs) == 2 * 2 * (size - 1) * 4 * sum(
        math.prod(s) for s in SHAPES
    )


def test_single_member_group_is_the_identity(cluster: Cluster):
    t = cluster.transports[0]
    avg = GroupAllReduce(t, [t.peer_id], key="solo")
    g = grads(1)
    out = cluster.run(avg.allreduce(0, g))
    assert all(a is b for a, b in zip(out, g, strict=True))
    cluster.run(avg.close())


async def _send_raw(transport: Transport, target, protocol: str, frames: list[tuple[dict, bytes]]):
    """Open a stream (its avg.hello names the frames' group, epoch 0), send frames; collect each reply kind or error code."""
    results = []
    conn = await transport.connect(target, protocol, timeout=10)
    try:
        await conn.send(hello(frames[0][0].get("group", "?"), 0).header())
        for header, payload in frames:
            try:
                reply, _ = await conn.request(header, payload, timeout=10)
                results.append(reply["kind"])
            except (ProtocolError, PeerUnavailable) as exc:
                results.append(exc.code.name)
    finally:
        await conn.close()
    return results


def test_non_members_are_refused(cluster: Cluster):
    avgs = make_group(cluster, 2, "closed", timeout=10)
    outsider, other_member = cluster.transports[4], cluster.transports[2]
    layout = layout_of(grads(0))
    msg = AvgMessage(KIND_PART, avgs[0].digest, 0, 1, 0, layout.numel, layout.signature())
    payload = build_codec(None).encode(torch.zeros(layout.numel // 2))[0]

    async def go():
        for a in avgs:
            await a.start()
        try:
            return [
                await _send_raw(t, avgs[0].transport.peer_id, avgs[0].protocol, [(msg.header(), payload)])
                for t in (outsider, other_member)
            ]
        finally:
            for a in avgs:
                await a.close()

    assert cluster.run(go()) == [["NOT_ALLOWED"], ["NOT_ALLOWED"]]


def test_bad_frames_get_typed_errors_are_counted_and_the_group_carries_on(cluster: Cluster):
    avgs = make_group(cluster, 2, "bad-frames", timeout=10)
    receiver, sender = avgs
    g = [[grads(7), grads(8)]]
    layout = layout_of(g[0][0])
    n0 = layout.numel // 2  # rank 1 sends rank 0 its share 0: the first half
    ok = AvgMessage(KIND_PART, receiver.digest, 1, 1, 0, layout.numel, layout.signature()).header()
    raw = build_codec(None)
    share_frame = raw.encode(torch.zeros(n0))[0]
    wrong_length = raw.encode(torch.ones(n0 + 1))[0]
    nan_frame = bytearray(share_frame)
    nan_frame[24 + 20 : 24 + 24] = struct.pack("<f", float("nan"))  # element 5 (24-byte frame head)
    frames = [
        (ok | {"step": 0}, share_frame),  # late: step 0 is done, the reply is its share again
        (ok | {"step": 5}, share_frame),  # too far ahead
        (ok | {"group": "0" * 16}, share_frame),
        (ok | {"src": 0}, share_frame),  # claims to be the receiver's rank
        (ok | {"share": 1}, share_frame),  # not the receiver's share
        ({k: v for k, v in ok.items() if k != "total"}, share_frame),
        (ok | {"v": 2}, share_frame),
        (ok, share_frame[:-7]),
        (ok, wrong_length),
        (ok, bytes(nan_frame)),
    ]

    async def go():
        for a in avgs:
            await a.start()
        try:
            await asyncio.gather(receiver.allreduce(0, g[0][0]), sender.allreduce(0, g[0][1]))
            codes = await _send_raw(sender.transport, receiver.transport.peer_id, receiver.protocol, frames)
            after = await asyncio.gather(receiver.allreduce(1, grads(9)), sender.allreduce(1, grads(10)))
            return codes, after
        finally:
            for a in avgs:
                await a.close()

    codes, after = cluster.run(go())
    assert codes == [
        "avg.share",
        "WRONG_STEP",
        "NOT_ALLOWED",
        "NOT_ALLOWED",
        "MALFORMED",
        "MALFORMED",
        "UNSUPPORTED_VERSION",
        "TRUNCATED",
        "SHAPE_MISMATCH",
        "NON_FINITE",
    ]
    assert receiver.stats.rejected == {
        "WRONG_STEP": 1,
        "NOT_ALLOWED": 2,
        "MALFORMED": 2,
        "UNSUPPORTED_VERSION": 1,
        "TRUNCATED": 1,
        "SHAPE_MISMATCH": 1,
        "NON_FINITE": 1,
    }
    expect = rank_order_mean([flatten(grads(9)), flatten(grads(10))])
    assert torch.equal(flatten(after[0]), expect) and torch.equal(flatten(after[1]), expect)


def test_a_member_that_never_joins_times_out_and_the_step_can_be_retried(cluster: Cluster):
    avgs = make_group(cluster, 2, "late", timeout=1.5)
    g0, g1 = grads(21), grads(22)

    async def go():
        for a in avgs:
            await a.start()
        try:
            with pytest.raises(PeerUnavailable) as info:
                await avgs[0].allreduce(0, g0)  # only the group's 1.5 s deadline can end this
            retried = await asyncio.gather(avgs[0].allreduce(0, g0), avgs[1].allreduce(0, g1))
            return info.value, retried
        finally:
            for a in avgs:
                await a.close()

    error, retried = cluster.run(go(), timeout=30)  # a hang guard: the step would wait forever
    assert error.code == ErrorCode.TIMEOUT
    expect = rank_order_mean([flatten(g0), flatten(g1)])
    assert all(torch.equal(flatten(r), expect) for r in retried)
    assert avgs[0].stats.failed == 1 and avgs[0].stats.steps == 1


def test_a_retry_that_comes_after_the_other_member_finished_gets_the_same_share(
    cluster: Cluster, monkeypatch
):
    """Rank 1 keeps rank 0's part of a failed attempt and finishes the retry before rank 0's new part arrives."""
    avgs = make_group(cluster, 2, "late-retry", timeout=1.5)
    g0, g1 = grads(23), grads(24)
    exchange = GroupAllReduce._exchange

    async def held_until_rank1_is_done(self, j, msg, payload, numel):
        if self is avgs[0] and avgs[0].stats.failed:  # the retry: rank 1 finishes step 0 first
            while avgs[1]._steps.last != msg.step:
                await asyncio.sleep(0.01)
        return await exchange(self, j, msg, payload, numel)

    monkeypatch.setattr(GroupAllReduce, "_exchange", held_until_rank1_is_done)

    async def go():
        for a in avgs:
            await a.start()
        try:
            with pytest.raises(PeerUnavailable):
                await avgs[0].allreduce(0, g0)
            return await asyncio.gather(avgs[0].allreduce(0, g0), avgs[1].allreduce(0, g1))
        finally:
            for a in avgs:
                await a.close()

    retried = cluster.run(go(), timeout=30)
    expect = rank_order_mean([flatten(g0), flatten(g1)])
    assert all(torch.equal(flatten(r), expect) for r in retried)
    assert avgs[1].stats.rejected == {}


def test_a_member_killed_mid_step_fails_the_others_within_the_timeout(cluster: Cluster):
    timeout = 4.0

    async def go():
        victim_p2p, victim_t = await cluster.new_peer()
        try:
            ids = [cluster.transports[0].peer_id, cluster.transports[1].peer_id, victim_t.peer_id]
            avgs = [GroupAllReduce(t, ids, key="kill", timeout=timeout) for t in cluster.transports[:2]]
            victim = GroupAllReduce(victim_t, ids, key="kill", timeout=timeout)
            for a in [*avgs, victim]:
                await a.start()
            await asyncio.gather(*(a.allreduce(0, grads(30 + r)) for r, a in enumerate([*avgs, victim])))
            # step 1: the survivors send; once the victim holds both contributions, its daemon dies
            tasks = [asyncio.create_task(a.allreduce(1, grads(40 + r))) for r, a in enumerate(avgs)]
            async with asyncio.timeout(30):  # a hang guard: the contributions are on their way
                while len(getattr(victim._steps.states.get(1), "parts", {})) < 2:
                    await asyncio.sleep(0.02)
            victim_p2p._child.kill()  # SIGKILL p2pd: no goodbye on any stream
            killed = time.monotonic()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            elapsed = time.monotonic() - killed
            for a in avgs:
                await a.close()
            await victim.close()
            return outcomes, elapsed
        finally:
            await victim_t.close()
            cluster.transports.remove(victim_t)
            cluster.p2ps.remove(victim_p2p)
            await victim_p2p.shutdown()

    outcomes, elapsed = cluster.run(go(), timeout=60)
    assert all(isinstance(o, PeerUnavailable) for o in outcomes), outcomes
    assert elapsed < 5 * timeout  # generous on purpose: it guards against waiting forever, not load


def test_benchmark_command_reports_ratios():
    from click.testing import CliRunner

    from peerd.bench.averaging import command

    result = CliRunner().invoke(
        command, ["--mib", "0.25", "--peers", "2", "--repeats", "1", "--mbit", "0"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    rows = {r["codec"]: r for r in json.loads(result.output)["results"]}
    assert set(rows) == {"none", "q8", "q4"}
    assert rows["none"]["wire_ratio_vs_fp32"] == 1.0
    assert 0.24 < rows["q8"]["wire_ratio_vs_fp32"] < 0.27
    assert 0.12 < rows["q4"]["wire_ratio_vs_fp32"] < 0.14
    assert all(r["mib_per_s"] > 0 for r in rows.values())


def test_a_group_that_follows_a_deadline_gives_up_on_a_silent_member_at_that_deadline(cluster: Cluster):
    """The configured timeout is two minutes; a worker's deadline learnt from one-second steps says
    2 s: a member that never contributes fails the step after about 2 s, not after two minutes."""
    from peerd.pipeline.deadlines import DeadlineConfig, StepDeadline

    deadline = StepDeadline(120.0, DeadlineConfig(factor=2.0, floor_s=1.0))
    avgs = make_group(cluster, 2, "follows", timeout=120.0)
    avgs[0].follow_deadline(deadline.seconds)
    assert avgs[0].timeout == 120.0  # no step seen yet: the configured limit
    for _ in range(2):
        deadline.observe(1.0)
    assert avgs[0].timeout == 2.0

    async def go():
        for a in avgs:
            await a.start()
        try:
            started = time.monotonic()
            with pytest.raises(PeerUnavailable) as info:
                await avgs[0].allreduce(0, grads(51))  # the other member never contributes
            return info.value, time.monotonic() - started
        finally:
            for a in avgs:
                await a.close()

    error, elapsed = cluster.run(go(), timeout=60)
    assert error.code == ErrorCode.TIMEOUT and "within 2 s" in str(error)
    assert elapsed < 30  # far below the configured 120 s (generous: a loaded machine)


@pytest.mark.parametrize("compressor", [None, "q8"])
def test_one_members_overflow_flag_reaches_every_member_and_its_step_keeps_no_residual(
    cluster: Cluster, compressor
):
    """fp16: member 1 flags step 1 (its zeros stand in for Inf gradients). Every member ends the step
    with ``any_overflowed``, the same bits as ever, and the residuals of before the step: step 2,
    unflagged, gives what it gives in a group that never ran step 1."""
    kw = {"timeout": 10.0, "compressor": compressor, "loss_scaled": True}
    flagged = make_group(cluster, 3, f"overflow-{compressor}", **kw)
    clean = make_group(cluster, 3, f"clean-{compressor}", **kw)
    zeros = [torch.zeros(s) for s in SHAPES]

    async def go():
        for a in [*flagged, *clean]:
            await a.start()
        try:
            await asyncio.gather(*(a.allreduce(0, grads(60 + r)) for r, a in enumerate(flagged)))
            await asyncio.gather(*(a.allreduce(0, grads(60 + r)) for r, a in enumerate(clean)))
            middle = await asyncio.gather(
                *(a.allreduce(1, zeros if r == 1 else grads(70 + r), r == 1) for r, a in enumerate(flagged))
            )
            verdicts = [a.any_overflowed for a in flagged]
            after = await asyncio.gather(*(a.allreduce(2, grads(80 + r)) for r, a in enumerate(flagged)))
            later = [a.any_overflowed for a in flagged]
            reference = await asyncio.gather(*(a.allreduce(2, grads(80 + r)) for r, a in enumerate(clean)))
            return middle, verdicts, after, later, reference
        finally:
            for a in [*flagged, *clean]:
                await a.close()

    middle, verdicts, after, later, reference = cluster.run(go(), timeout=60)
    assert verdicts == [True] * 3 and later == [False] * 3
    assert all(torch.equal(flatten(m), flatten(middle[0])) for m in middle)  # still one result everywhere
    assert all(torch.equal(flatten(a), flatten(r)) for a, r in zip(after, reference, strict=True))


def test_a_group_that_does_not_scale_its_loss_refuses_overflow_flags(cluster: Cluster):
    """Only fp16 jobs skip steps: elsewhere a member's flag is NOT_ALLOWED, so no member can make
    a group of another job drop its error-feedback residuals."""
    avgs = make_group(cluster, 2, "unscaled", timeout=10.0)
    with pytest.raises(ConfigError):
        cluster.run(avgs[0].allreduce(0, grads(90), True), timeout=10)
    avgs[1].loss_scaled = True  # a member that flags anyway (as a hostile peer would)

    async def go():
        for a in avgs:
            await a.start()
        try:
            return await asyncio.gather(
                avgs[0].allreduce(0, grads(91)), avgs[1].allreduce(0, grads(92), True), return_exceptions=True
            )
        finally:
            for a in avgs:
                await a.close()

    outcomes = cluster.run(go(), timeout=60)
    assert all(isinstance(o, PeerdError) for o in outcomes), outcomes
    assert avgs[0].stats.rejected.get("NOT_ALLOWED") == 1


def test_a_member_that_closes_right_after_its_step_still_delivers_the_share_it_was_sending(
    cluster: Cluster,
):
    """X's link to Y is slow, Y's to X fast, and Y joins the step late: X gets its share back
    while its handler is still pacing Y's averaged share out. X closing then (a job's last step)
    must let that frame finish: cut short, it failed Y's step and re-planned the job at its end."""
    from peerd.swarm.shaper import LinkShaper, LinkSpec

    numel = 250_000  # two 500 KB fp32 shares: 1 s each over the 4 Mbit/s link
    late_s = 0.5

    async def go():
        (x_p2p, x), (y_p2p, y) = await cluster.new_peer(), await cluster.new_peer()
        x.shaper = LinkShaper.uniform(LinkSpec(bandwidth_bps=4e6))
        try:
            ids = [x.peer_id, y.peer_id]
            gx, gy = (GroupAllReduce(t, ids, key="last-step", timeout=20) for t in (x, y))
            await gx.start()
            await gy.start()
            g = torch.Generator().manual_seed(7)
            values = [torch.randn(numel, generator=g) for _ in range(2)]

            async def late_y():
                await asyncio.sleep(late_s)
                return await gy.allreduce(0, [values[1]])

            y_task = asyncio.create_task(late_y())
            (x_mean,) = await gx.allreduce(0, [values[0]])
            still_sending = gx._replying  # Y's share is still going out on X's slow link
            await gx.close()
            (y_mean,) = await y_task
            await gy.close()
            return still_sending, x_mean, y_mean, (values[0] + values[1]) / 2
        finally:
            for t, p in ((x, x_p2p), (y, y_p2p)):
                await t.close()
                cluster.transports.remove(t)
                cluster.p2ps.remove(p)
                await p.shutdown()

    still_sending, x_mean, y_mean, mean = cluster.run(go(), timeout=60)
    assert still_sending == 1  # the case under test: X's step ended before its reply had left
    assert torch.equal(x_mean, y_mean) and torch.allclose(x_mean, mean, atol=1e-6)


def test_an_honest_spike_is_averaged_and_an_absurd_contribution_refused_by_the_whole_gradient_screen(
    cluster: Cluster,
):
    """Each reducer judges the others' slices of its share against its own whole gradient's norm:
    rank 0's slice of share 0 is ~0 (an embedding its batch never touched) while rank 1's is 1e6x
    larger, honestly; rank 2's contribution, 1e6x everything, is refused, naming rank 2."""
    quiet = grads(1)
    quiet[0][:100] *= 1e-6  # rows 0-99 of the first tensor: all of share 0 of three
    honest = [quiet, grads(2), grads(3)]
    avgs = make_group(cluster, 3, "screen-honest", timeout=10)
    out = cluster.run(steps(avgs, [honest]))[0]
    expect = rank_order_mean([flatten(g) for g in honest])
    assert all(torch.equal(flatten(o), expect) for o in out)

    hostile = [quiet, grads(2), [t * 1e6 for t in grads(3)]]
    avgs = make_group(cluster, 3, "screen-hostile", timeout=10)

    async def go():
        for a in avgs:
            await a.start()
        try:
            return await asyncio.gather(
                *(a.allreduce(0, g) for a, g in zip(avgs, hostile, strict=True)), return_exceptions=True
            )
        finally:
            for a in avgs:
                await a.close()

    results = cluster.run(go())
    for got in results[:2]:  # the honest reducers refuse it; every member's step fails
        assert isinstance(got, PeerdError) and got.code == ErrorCode.OUT_OF_RANGE, got
        assert f"rank 2 ({avgs[2].transport.peer_id})" in str(got)
    assert isinstance(results[2], PeerdError)
