"""The rl job's roles over real p2pd daemons on loopback: one trainer, rollout peers, weights and rollouts on the wire."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from peerd.averaging import GroupAllReduce
from peerd.errors import ErrorCode, PeerUnavailable, ProtocolError
from peerd.jobs.fetch import assemble
from peerd.jobs.rl import Learner, RLPlan, RLTrainer, RolloutConfig, RolloutPeer, TrainerConfig, reference_run
from peerd.jobs.rl.means import TrainerMeans, trainer_means
from peerd.jobs.rl.messages import (
    KIND_ACK,
    KIND_STATUS,
    Ack,
    Poll,
    RolloutGroupWire,
    Rollouts,
    header,
    parse,
    rl_protocol,
    to_wire,
)
from peerd.jobs.rl.shards import assign_shards, sample_shard, shard_ranges
from peerd.jobs.spec import parse_job_spec
from peerd.models import load_checkpoint
from peerd.pipeline.statesync import StateSyncConfig
from peerd.rl.tasks import END_TOKEN
from peerd.swarm.transport import RetryPolicy, Transport
from peerd.wire import to_builtin

pytestmark = pytest.mark.integration

FAST_SYNC = StateSyncConfig(connect_timeout_s=5, request_timeout_s=10, deadline_s=30)
TRAINER: list[Any] = []  # the trainer's peer id, for the forging helpers


def plan(
    job: str,
    *,
    iterations: int = 4,
    staleness: int = 0,
    timeout_s: float = 60.0,
    warmup: int = 30,
    global_batch: int = 24,
    micro_batch: int = 12,
    gradient_bits: int | None = None,
    averaging: dict[str, Any] | None = None,
) -> RLPlan:
    trainers = 3 if averaging else 2 if gradient_bits is not None else "auto"
    spec = parse_job_spec(
        {
            "compression": {"gradient_bits": gradient_bits},
            "averaging": averaging or {},
            "parallel": {"d_pp": 1, "d_dp": trainers},
            "kind": "rl",
            "name": "rl-roles",
            "model": {"preset": "tiny", "seed": 3},
            "steps": iterations,
            "global_batch": global_batch,  # 6 prompts x 4 completions by default
            "micro_batch": micro_batch,  # two updates per iteration by default
            "min_peers": 3,
            "optimizer": {"name": "adamw", "lr": 0.003, "schedule": "constant", "grad_clip": 1.0},
            "rl": {
                "task": {"name": "addition", "min_size": 1, "max_size": 1},
                "group_size": 4,
                "staleness": staleness,
                "sampling": {"max_new_tokens": 4, "temperature": 1.0},
                "warmup": {"steps": warmup, "batch_size": 16, "lr": 0.003},
                "rollout_timeout_s": timeout_s,
            },
        }
    )
    return RLPlan(job, spec)


class Swarm:
    """p2pd daemons on one event loop, a Transport each: ``trainer``, two rollout peers and a stranger."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.p2ps: list[P2P] = []
        self.transports: list[Transport] = []

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def peer(self) -> Transport:
        known = [m for p in self.p2ps for m in await p.get_visible_maddrs()]
        p2p = await P2P.create(initial_peers=known)
        self.p2ps.append(p2p)
        transport = Transport(p2p, retry=RetryPolicy(attempts=2, base_backoff_s=0.05, ban_after_failures=50))
        self.transports.append(transport)
        return transport

    async def start(self) -> None:
        self.trainer, self.r1, self.r2, self.stranger = [await self.peer() for _ in range(4)]

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


def rollout_peers(
    swarm: Swarm, p: RLPlan, transports: list[Transport], inline_weights_bytes: int = 16 << 20
) -> list[RolloutPeer]:
    ids = sorted((t.peer_id for t in transports), key=str)
    shards = assign_shards(p.prompts, 1, [str(i) for i in ids])
    cfg = RolloutConfig(
        request_timeout_s=30,
        trainer_timeout_s=30,
        statesync=FAST_SYNC,
        inline_weights_bytes=inline_weights_bytes,
    )
    return [
        RolloutPeer(t, p, swarm.trainer.peer_id, shards[ids.index(t.peer_id)], config=cfg) for t in transports
    ]


async def train(
    swarm: Swarm,
    p: RLPlan,
    transports: list[Transport],
    *,
    also: Callable[[RLTrainer, list[asyncio.Future]], Awaitable[None]] | None = None,
    tolerate: bool = False,
    inline_weights_bytes: int = 16 << 20,
    gone: Callable[[str], bool] = lambda _peer: False,
    **options: Any,
) -> tuple[RLTrainer, list]:
    """Run the job to its end; ``also(trainer, rollout tasks)`` runs beside it; ``tolerate``: rollout peers may fail."""
    TRAINER[:] = [swarm.trainer.peer_id]
    trainer = RLTrainer(
        swarm.trainer,
        p,
        [t.peer_id for t in transports],
        config=TrainerConfig(poll_hold_s=5, statesync=FAST_SYNC, **options),
        gone=gone,
    )
    workers = rollout_peers(swarm, p, transports, inline_weights_bytes)
    tasks = [asyncio.ensure_future(w.run()) for w in workers]  # they poll while the trainer warms up
    await trainer.start()
    try:
        side = [asyncio.ensure_future(also(trainer, tasks))] if also is not None else []
        await trainer.run()
        await asyncio.gather(*side)
        stats = await asyncio.gather(*tasks, return_exceptions=tolerate)
    finally:
        await trainer.close()
    return trainer, stats


@pytest.mark.parametrize("inline", [True, False], ids=["weights-in-poll-answers", "weights-by-state-sync"])
def test_sync_job_equals_the_single_process_reference(swarm: Swarm, tmp_path, inline: bool):
    p = plan(("a1" if inline else "a2") * 16)
    trainer, stats = swarm.run(
        train(
            swarm,
            p,
            [swarm.r1, swarm.r2],
            checkpoint_root=tmp_path,
            inline_weights_bytes=(16 << 20) if inline else 0,
        )
    )
    ref = reference_run(p, rollout_peers=2)
    got = trainer.reports
    assert [r.iteration for r in got] == [0, 1, 2, 3]
    for mine, want in zip(got, ref, strict=True):
        assert mine.rollouts == want.rollouts == 24 and mine.shards == 2 and mine.staleness == {0: 24}
        assert mine.pass_rate == want.pass_rate and mine.reward_mean == pytest.approx(
            want.reward_mean, abs=1e-12
        )
        assert mine.loss == pytest.approx(want.loss, abs=1e-5)
        assert mine.kl == pytest.approx(want.kl, abs=1e-5)
        assert mine.response_len == want.response_len
        assert "average" not in mine.seconds  # a lone trainer averages nothing
    # every shard was sampled by the version of its iteration (sync), weights crossed the wire
    assert [s.versions for s in stats] == [[0, 1, 2, 3]] * 2
    assert all(s.weight_fetches == 4 for s in stats)
    assert sum(r.weight_sync_bytes for r in got) + 0 >= sum(s.weight_bytes for s in stats) > 0
    # the poll's answer carried the weights, or every version was fetched by state sync
    assert (trainer._weights.bytes_served == 0) == inline
    assert trainer.refused == {} and trainer.missing_shards == 0
    # the checkpoint is the one-stage format: peerd fetch assembles it and load_checkpoint loads it
    fetched = assemble(p.job_id, p.spec, [tmp_path], tmp_path / "out")
    assert fetched.step == 4 and fetched.stages == 1
    model = load_checkpoint(fetched.path)
    for name, tensor in trainer.learner.policy.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # and a next rl job may start from it (``init_checkpoint``): its policy and reference are this one
    then = Learner(RLPlan("n" * 32, dataclasses.replace(p.spec, init_checkpoint=str(fetched.path))))
    then.warm_up()  # the spec's 30 warm-up steps continue from the checkpoint
    fresh = Learner(RLPlan("n" * 32, p.spec))
    fresh.policy.load_state_dict(trainer.learner.policy.state_dict())
    fresh.warm_up()  # what a trainer that held the policy would have warmed up into
    for name, tensor in fresh.policy.state_dict().items():
        assert torch.equal(then.policy.state_dict()[name], tensor), name
        assert torch.equal(then.reference.state_dict()[name], tensor), name


def two_trainers(
    swarm: Swarm, p: RLPlan, means: Callable[[Transport, list[Any]], TrainerMeans]
) -> tuple[list[RLTrainer], Any]:
    """Trainers 0 (on ``swarm.trainer``, fed by the rollout peer ``r2``) and 1 (on ``r1``, sampling its
    own half) of ``p``, averaging over ``means(transport, ids)``; their trainers and r2's stats."""

    async def go() -> tuple[list[RLTrainer], Any]:
        hosts = [swarm.trainer, swarm.r1]
        ids = [t.peer_id for t in hosts]
        trainers = [
            RLTrainer(
                t,
                p,
                [swarm.r2.peer_id],
                config=TrainerConfig(poll_hold_s=5, statesync=FAST_SYNC),
                trainers=2,
                replica=r,
                group=means(t, ids),
            )
            for r, t in enumerate(hosts)
        ]
        (shard,) = [s for s in assign_shards(p.prompts, 2, [str(swarm.r2.peer_id)]) if s.sampler]
        assert shard.trainer == 0 and shard.problems == range(0, 4)
        cfg = RolloutConfig(request_timeout_s=30, trainer_timeout_s=30, statesync=FAST_SYNC)
        rolling = asyncio.ensure_future(
            RolloutPeer(swarm.r2, p, swarm.trainer.peer_id, shard, config=cfg).run()
        )
        await asyncio.gather(*(t.start() for t in trainers))
        try:
            await asyncio.gather(*(t.run() for t in trainers))
            return trainers, await rolling
        finally:
            for t in trainers:
                await t.close()

    return swarm.run(go(), timeout=300)  # type: ignore[no-any-return]


def test_data_parallel_trainers_one_fed_by_a_rollout_peer_one_colocated_equal_the_reference(swarm: Swarm):
    """Two trainers average every update; the rollout peer serves trainer 0, trainer 1 samples its half."""
    p = plan("d1" * 16, global_batch=32, micro_batch=16)  # 8 prompts, 4 per trainer; 2 groups each per update
    (first, second), stats = two_trainers(
        swarm, p, lambda t, ids: TrainerMeans(GroupAllReduce(t, ids, key=f"rl/{p.job_id}/0", timeout=60))
    )
    ref = reference_run(p, rollout_peers=1, trainers=2)
    assert len(first.reports) == len(second.reports) == len(ref) == 4
    for a, b, want in zip(first.reports, second.reports, ref, strict=True):
        # the rewards are pooled over both trainers' groups (an fp32 mean): the same on each, and the reference's
        assert a.rollouts == b.rollouts == want.rollouts == 32 and a.shards == b.shards == 1
        assert a.reward_mean == b.reward_mean == pytest.approx(want.reward_mean, abs=1e-6)
        assert a.pass_rate == b.pass_rate == pytest.approx(want.pass_rate, abs=1e-6)
        assert a.loss == b.loss == pytest.approx(want.loss, abs=1e-4)
        assert a.staleness == b.staleness == {0: 16}  # each trainer counts its own completions
        # the time in the gradient averages is part of training, and both trainers spend some
        assert 0 < a.seconds["average"] <= a.seconds["train"] and b.seconds["average"] > 0
        assert 0 <= a.seconds["average_wait"] <= a.seconds["average"]  # the wait for the other trainer
    mine, theirs = first.learner.policy.state_dict(), second.learner.policy.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)  # averaged: bit-equal replicas
    assert stats.versions == [0, 1, 2, 3] and stats.weight_fetches == 4  # from trainer 0 only
    assert second.weight_sync_bytes == 0 and second.covered_shards == 0  # its own shard is not a cover
    assert first.refused == {} == second.refused


def test_data_parallel_trainers_compress_their_gradients_and_keep_their_figures_exact(swarm: Swarm):
    """``compression.gradient_bits: 8``: the updates' gradients travel as 8-bit codes with error
    feedback, a little over a quarter of their fp32 bytes; the group counts that scale them, the
    figures and the start weights travel exact, so both trainers report the same pooled figures and
    hold bit-equal policies."""
    p = plan("d3" * 16, global_batch=32, micro_batch=16, gradient_bits=8)
    made: list[TrainerMeans] = []

    def means(transport: Transport, ids: list[Any]) -> TrainerMeans:
        made.append(trainer_means(transport, ids, p, epoch=0))
        return made[-1]

    (first, second), _ = two_trainers(swarm, p, means)
    ref = reference_run(p, rollout_peers=1, trainers=2)  # the same job averaging in fp32
    for a, b in zip(first.reports, second.reports, strict=True):
        assert a.rollouts == b.rollouts == 32
        assert (a.reward_mean, a.pass_rate, a.loss, a.kl) == (b.reward_mean, b.pass_rate, b.loss, b.kl)
    # iteration 0 is sampled before any update: its pooled rewards are the fp32 run's
    assert first.reports[0].reward_mean == pytest.approx(ref[0].reward_mean, abs=1e-6)
    assert first.reports[0].loss == pytest.approx(ref[0].loss, abs=1e-2)
    mine, theirs = first.learner.policy.state_dict(), second.learner.policy.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    for m in made:
        assert m.exact is not None
        gradients, exact = m.gradients.stats, m.exact.stats
        assert gradients.steps == 4 * 2 and exact.steps == 2 + 4 * 2  # the alignment's two go exact only
        assert 0.25 < gradients.bytes_sent / gradients.raw_bytes_sent < 0.3
        assert exact.bytes_sent > exact.raw_bytes_sent > 0  # fp32 and the frames' headers
    # each trainer's reports count what its groups sent: its record's ``averaging`` bytes
    for trainer, m in zip((first, second), made, strict=True):
        sent = (
            sum(r.averaging_bytes for r in trainer.reports),
            sum(r.averaging_raw_bytes for r in trainer.reports),
        )
        assert sent == m.bytes_sent() and 0.25 < sent[0] / sent[1] < 0.5


def test_async_data_parallel_trainers_stay_within_the_bound_and_equal(swarm: Swarm):
    """Staleness 1 with two compressing trainers: trainer 0's rollout peer samples ahead of it, trainer
    1 samples its own half on-policy; every update is averaged, so the replicas stay bit-equal."""
    p = plan("d4" * 16, iterations=5, staleness=1, global_batch=32, micro_batch=16, gradient_bits=8)
    (first, second), stats = two_trainers(swarm, p, lambda t, ids: trainer_means(t, ids, p, epoch=0))
    assert len(first.reports) == len(second.reports) == 5
    for a, b in zip(first.reports, second.reports, strict=True):
        assert a.rollouts == b.rollouts == 32 and (a.reward_mean, a.loss) == (b.reward_mean, b.loss)
        assert set(a.staleness) <= {0, 1} and sum(a.staleness.values()) == 16
        assert b.staleness == {0: 16}  # its own half, sampled with its current policy
    assert sum(r.staleness.get(1, 0) for r in first.reports) > 0  # the rollout peer ran ahead
    mine, theirs = first.learner.policy.state_dict(), second.learner.policy.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert max(stats.versions) <= 5 and first.refused == {} == second.refused


def test_compressing_means_keep_the_exact_tail_exact_and_fail_with_the_groups_error(swarm: Swarm):
    """A call's last ``exact`` tensors are averaged losslessly beside the 8-bit rest; a member that
    never calls fails the other's call with the averaging's own error, as an uncompressed group does."""
    hosts = [swarm.trainer, swarm.r1]
    ids = [h.peer_id for h in hosts]

    def means(t: Transport, key: str) -> TrainerMeans:
        return TrainerMeans(
            GroupAllReduce(t, ids, key=key, compressor="q8", timeout=2),
            GroupAllReduce(t, ids, key=f"{key}/exact", timeout=2),
        )

    grads = [torch.linspace(-1, 1, 1000) * (r + 1) for r in range(2)]
    counts = [torch.tensor([3.0, 1 / 3]), torch.tensor([5.0, 2 / 7])]

    async def go() -> tuple[list[list[torch.Tensor]], BaseException]:
        pairs = [means(t, "m1") for t in hosts]
        loop = asyncio.get_running_loop()
        try:
            calls = [pair.mean(loop) for pair in pairs]
            got = await asyncio.gather(
                *(asyncio.to_thread(c, [g, n], 1) for c, g, n in zip(calls, grads, counts, strict=True))
            )
        finally:
            for pair in pairs:
                await pair.close()
        alone = means(hosts[0], "m2")
        try:
            await asyncio.to_thread(alone.mean(loop), [grads[0], counts[0]], 1)
        except BaseException as exc:
            return got, exc
        finally:
            await alone.close()
        raise AssertionError("a call without the other member succeeded")

    (first, second), error = swarm.run(go())
    assert torch.equal(first[1], (counts[0] + counts[1]) / 2) and torch.equal(first[1], second[1])
    assert torch.equal(first[0], second[0]) and not torch.equal(first[0], (grads[0] + grads[1]) / 2)
    assert torch.allclose(first[0], (grads[0] + grads[1]) / 2, atol=2 * 2 / 127)
    assert isinstance(error, PeerUnavailable), repr(error)  # not an ExceptionGroup of the two groups


def test_trainers_average_gradients_of_very_different_norms(swarm: Swarm):
    """A trainer whose groups all scored alike has only the KL term's gradient: far smaller than
    another's, and honest. Averaging's relative screen would refuse the other (and again after every
    re-plan, on the same rollouts); the trainers' group takes both."""
    p = plan("d2" * 16)
    hosts = [swarm.trainer, swarm.r1]
    groups = [trainer_means(t, [h.peer_id for h in hosts], p, epoch=0) for t in hosts]
    small, big = torch.full((64,), 1e-6), torch.full((64,), 10.0)

    async def go() -> list[list[torch.Tensor]]:
        try:
            return await asyncio.gather(
                groups[0].gradients.allreduce(0, [small]), groups[1].gradients.allreduce(0, [big])
            )
        finally:
            for g in groups:
                await g.close()

    first, second = swarm.run(go())
    assert torch.equal(first[0], second[0]) and torch.allclose(first[0], (small + big) / 2)


def test_robust_trainers_bound_one_huge_gradient_and_keep_their_figures_exact(swarm: Swarm):
    """With ``averaging.aggregator: clipped`` a trainer sending a gradient 1e6x the others' moves the
    mean by at most the clip ratio x the median norm over the trainers, on every trainer alike; the
    group counts that scale the gradients still come back exact (their own, lossless group)."""
    p = plan("c3" * 16, averaging={"aggregator": "clipped", "clip_ratio": 2.0})
    hosts = [swarm.trainer, swarm.r1, swarm.r2]
    means = [trainer_means(t, [h.peer_id for h in hosts], p, epoch=0) for t in hosts]
    assert all(m.exact is not None for m in means)
    honest = [torch.linspace(-1, 1, 500) * (r + 1) for r in range(2)]
    hostile = torch.full((500,), 1e6)
    counts = [torch.tensor([3.0, 1 / 3]), torch.tensor([5.0, 2 / 7]), torch.tensor([4.0, 0.5])]

    async def go() -> list[list[torch.Tensor]]:
        loop = asyncio.get_running_loop()
        try:
            calls = [m.mean(loop) for m in means]
            return await asyncio.gather(
                *(
                    asyncio.to_thread(call, [g, n], 1)
                    for call, g, n in zip(calls, [*honest, hostile], counts, strict=True)
                )
            )
        finally:
            for m in means:
                await m.close()

    got = swarm.run(go())
    assert all(torch.equal(g[0], got[0][0]) and torch.equal(g[1], got[0][1]) for g in got)
    assert torch.equal(got[0][1], (counts[0] + counts[1] + counts[2]) / 3)  # exact, unclipped
    # each share: the hostile part cut to 2 x the median part's norm (the larger honest one's)
    bound = 2 * float(honest[1].norm()) / 3
    moved = float((got[0][0] - (honest[0] + honest[1]) / 3).norm())
    assert moved <= bound * 1.001
    plain = (honest[0] + honest[1] + hostile) / 3  # what the mean would have been: ~1e6 per value
    assert float(got[0][0].norm()) < 1e-4 * float(plain.norm())


def test_async_rollouts_stay_within_the_bound_and_stale_ones_are_counted(swarm: Swarm, async_wait_until):
    p = plan("a2" * 16, iterations=5, staleness=1)
    acks: list[Ack] = []

    async def forge_stale(trainer: RLTrainer, _: list[asyncio.Future]) -> None:
        """Shard 0's owner sends a well-formed shard of iteration 3 sampled by version 1: 2 behind."""
        owner = min([swarm.r1, swarm.r2], key=lambda t: str(t.peer_id))
        await async_wait_until(lambda: trainer.iteration >= 2, 60, "iteration 2")
        acks.append(await push(owner, p, iteration=3, shard=0, version=1))

    trainer, stats = swarm.run(train(swarm, p, [swarm.r1, swarm.r2], also=forge_stale))
    reports = trainer.reports
    assert len(reports) == 5 and all(r.rollouts == 24 and r.shards == 2 for r in reports)
    assert all(set(r.staleness) <= {0, 1} and sum(r.staleness.values()) == 24 for r in reports)
    # rollout peers sample iteration u while the trainer trains u - 1: lag 1 is the steady state
    assert sum(r.staleness.get(1, 0) for r in reports) >= 24
    assert max(max(s.versions) for s in stats) <= 5
    # the stale shard: answered "not accepted", counted as 12 dropped completions, never trained on
    assert len(acks) == 1 and not acks[0].accepted and acks[0].reason
    assert trainer.dropped_stale + trainer.dropped_late == 12
    assert sum(r.dropped_stale + r.dropped_late for r in reports) == 12
    assert trainer.refused == {}


@pytest.mark.parametrize("listed", [True, False], ids=["still-listed", "left-the-swarm"])
def test_a_vanished_rollout_peer_costs_only_its_shard_in_flight(swarm: Swarm, async_wait_until, listed: bool):
    """Its shard is dropped at the deadline (2 s), or, once the swarm no longer lists the peer,
    within a check of that (here the deadline is 120 s, and the job takes far less)."""
    p = plan(("a3" if listed else "a5") * 16, iterations=5, timeout_s=2.0 if listed else 120.0)
    victim: list[Transport] = []
    dead: set[str] = set()

    async def kill(trainer: RLTrainer, tasks: list[asyncio.Future]) -> None:
        await async_wait_until(lambda: trainer.iteration >= 2, 60, "iteration 2")
        await victim[0].p2p.shutdown()
        await victim[0].close()
        tasks[1].cancel()  # the victim's process is gone with its daemon
        if not listed:
            dead.add(str(victim[0].peer_id))  # its record expired: the swarm lists it no more

    async def go() -> tuple[RLTrainer, list]:
        victim.append(await swarm.peer())
        started = time.monotonic()
        out = await train(swarm, p, [swarm.r1, victim[0]], also=kill, tolerate=True, gone=dead.__contains__)
        took.append(time.monotonic() - started)
        return out

    took: list[float] = []
    trainer, _ = swarm.run(go(), timeout=240)
    assert listed or took[0] < 60, f"the trainer waited for the vanished peer: {took[0]:.0f} s"
    reports = trainer.reports
    assert [r.iteration for r in reports] == [0, 1, 2, 3, 4]
    assert trainer.missing_shards == 1 and [r.shards_missing for r in reports].count(1) == 1
    lost = next(r.iteration for r in reports if r.shards_missing)
    assert lost >= 2 and all(
        r.rollouts == 24 and r.shards == 2 for r in reports[:lost]
    )  # both until the kill
    assert reports[lost].rollouts == 12 and reports[lost].shards == 1  # the shard in flight is dropped
    # later iterations: not waited for again; the trainer samples the victim's shard itself
    assert all(r.shards_covered == 1 and r.rollouts == 24 for r in reports[lost + 1 :])
    assert sum(r.rollouts for r in reports) == 5 * 24 - 12  # only the in-flight shard was lost


def test_forged_rollout_frames_are_refused_and_never_trained_on(swarm: Swarm, async_wait_until):
    p = plan("a4" * 16, iterations=1, warmup=100)

    async def go() -> tuple[dict[str, ErrorCode], RLTrainer]:
        TRAINER[:] = [swarm.trainer.peer_id]
        trainer = RLTrainer(
            swarm.trainer,
            p,
            [swarm.r1.peer_id, swarm.r2.peer_id],
            config=TrainerConfig(poll_hold_s=0.2, statesync=FAST_SYNC),
        )
        owner = sorted([swarm.r1, swarm.r2], key=lambda t: str(t.peer_id))
        codes: dict[str, ErrorCode] = {}
        starting = asyncio.ensure_future(trainer.start())
        await async_wait_until(lambda: trainer._served, 30, "the trainer to serve")
        # during the warm-up (100 steps) a poll is held, then answered "not ready"
        warming = await request(owner[0], p, header(Poll(want=0)), KIND_STATUS)
        assert not warming.ready and not warming.done
        await starting
        ready = await request(owner[0], p, header(Poll(want=0)), KIND_STATUS)
        assert ready.ready and ready.version == 0
        try:
            good = (await frame(p, trainer, 0, 0, 0)).groups
            for name, forged, sender in [
                ("bad token id", mutate(good, token=300), owner[0]),
                ("NaN log-prob", mutate(good, logprob=float("nan")), owner[0]),
                ("positive log-prob", mutate(good, logprob=0.5), owner[0]),
                ("too long", mutate(good, extend=9), owner[0]),
                ("wrong iteration", dict(iteration=3), owner[0]),
                ("beyond the job", dict(iteration=p.iterations + 7), owner[0]),
                ("from the future", dict(version=5), owner[0]),
                ("another's shard", {}, owner[1]),
                ("a stranger", {}, swarm.stranger),
            ]:
                fields = {"groups": forged} if isinstance(forged, list) else forged
                msg = Rollouts(**{"iteration": 0, "shard": 0, "version": 0, "groups": good, **fields})
                with pytest.raises(ProtocolError) as info:
                    await send_raw(sender, p, header_unchecked(msg))
                codes[name] = info.value.code
            assert not any(trainer.intake.arrived.values())  # nothing of them was kept
            workers = rollout_peers(swarm, p, [swarm.r1, swarm.r2])
            tasks = [asyncio.ensure_future(w.run()) for w in workers]
            await trainer.run()
            await asyncio.gather(*tasks)
        finally:
            await trainer.close()
        return codes, trainer

    codes, trainer = swarm.run(go())
    assert codes == {
        "bad token id": ErrorCode.OUT_OF_RANGE,
        "NaN log-prob": ErrorCode.NON_FINITE,
        "positive log-prob": ErrorCode.OUT_OF_RANGE,
        "too long": ErrorCode.OVERSIZED,
        "wrong iteration": ErrorCode.WRONG_STEP,
        "beyond the job": ErrorCode.WRONG_STEP,
        "from the future": ErrorCode.FROM_FUTURE,
        "another's shard": ErrorCode.NOT_ALLOWED,
        "a stranger": ErrorCode.NOT_ALLOWED,
    }
    # refused frames were counted by the trainer (the stranger's stream never reached it)
    assert sum(trainer.refused.values()) == 8
    # what was trained is exactly the honest peers' rollouts: the reference's iteration
    (mine,), (want,) = trainer.reports, reference_run(p, rollout_peers=2)
    assert mine.rollouts == 24 and mine.loss == pytest.approx(want.loss, abs=1e-5)
    assert mine.kl == pytest.approx(want.kl, abs=1e-5) and mine.pass_rate == want.pass_rate


# ---------------------------------------------------------------- helpers of the forging tests


async def frame(p: RLPlan, trainer: RLTrainer, iteration: int, shard: int, version: int) -> Rollouts:
    """An honest shard, sampled by the trainer's current policy."""
    groups = sample_shard(trainer.learner.policy, p, iteration, shard, trainer.shards[shard], version)
    wire = to_wire(
        [(i, g.completions, g.logprobs) for i, g in zip(trainer.shards[shard], groups, strict=True)]
    )
    return Rollouts(iteration=iteration, shard=shard, version=version, groups=wire)


def mutate(groups: list, *, token: int | None = None, logprob: float | None = None, extend: int = 0) -> list:
    out = copy.deepcopy(groups)
    first = out[0]
    if token is not None:
        first.completions[0][0] = token
    if logprob is not None:
        first.logprobs[0][0] = logprob
    if extend:
        first.completions[0] = [ord("1")] * extend
        first.logprobs[0] = [-0.5] * extend
    return out


def header_unchecked(msg: Rollouts) -> dict[str, Any]:
    """The header a forger writes: no schema checks on the way out."""
    return to_builtin(msg)


async def request(sender: Transport, p: RLPlan, head: dict[str, Any], kind: str) -> Any:
    conn = await sender.connect(TRAINER[0], rl_protocol(p.job_id), timeout=10)
    try:
        raw, _ = await conn.request(head, timeout=30)
        return parse(raw, (kind,))
    finally:
        await conn.close(timeout=1.0)


async def send_raw(sender: Transport, p: RLPlan, head: dict[str, Any]) -> Ack:
    ack: Ack = await request(sender, p, head, KIND_ACK)
    return ack


async def push(sender: Transport, p: RLPlan, *, iteration: int, shard: int, version: int) -> Ack:
    """A well-formed shard (its content does not matter: it must be dropped before use)."""
    groups = [
        RolloutGroupWire(
            problem=i,
            completions=[[ord("1"), END_TOKEN]] * p.group_size,
            logprobs=[[-1.0, -1.0]] * p.group_size,
        )
        for i in shard_ranges(p.prompts, 2)[shard]
    ]
    msg = Rollouts(iteration=iteration, shard=shard, version=version, groups=groups)
    return await send_raw(sender, p, header(msg))
