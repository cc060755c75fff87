"""RLRunner across commits on real p2pd daemons: trainer and rollout roles from the allocation, a re-plan, progress."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.jobs.catalog import read_progress
from peerd.jobs.records import TaskState, new_job_record
from peerd.jobs.rl.rollout import RolloutConfig
from peerd.jobs.rl.runner import RLRunner
from peerd.jobs.rl.trainer import TrainerConfig
from peerd.jobs.spec import JobSpec, ParallelSpec, parse_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.pipeline import checkpoint
from peerd.pipeline.launch import start_peers, stop_peers
from peerd.pipeline.replicas import CheckpointReplicas, check_checkpoint
from peerd.pipeline.statesync import StateSyncConfig
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import RosterDevice, RosterEntry
from peerd.swarm.node import parse_peer_id

ITERATIONS = 6


def rl_spec(iterations: int) -> JobSpec:
    return parse_job_spec(
        {
            "kind": "rl",
            "name": "rl-runner",
            "model": {"preset": "tiny", "seed": 1},
            "steps": iterations,
            "global_batch": 24,
            "micro_batch": 24,
            "min_peers": 2,
            "checkpoint_interval": 3,
            "rl": {
                "task": {"name": "addition", "min_size": 1, "max_size": 1},
                "group_size": 4,
                "sampling": {"max_new_tokens": 4},
                "warmup": {"steps": 10, "batch_size": 8},
                "rollout_timeout_s": 30,
            },
        }
    )


SPEC = rl_spec(ITERATIONS)
SYNC = StateSyncConfig(connect_timeout_s=5, request_timeout_s=10, deadline_s=30)


def commit(epoch: int, allocation: Allocation) -> Commit:
    """What the runner reads of a commit: its epoch and allocation."""
    return Commit(epoch, 0, allocation, "00" * 32, "00" * 32, 1.0, record=None)  # type: ignore[arg-type]


async def _scenario(tmp_path: Path, wait: Any) -> None:
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", SPEC, b"r" * 16, now=time.time(), epoch0_start=0.0, timing=SPEC.planning.timing()
    )
    runners = [
        RLRunner(
            job,
            SPEC,
            store=dht.client(ids[i]),
            transport=peers[i].transport,
            peer_ref=parse_peer_id,
            checkpoint_root=tmp_path / f"p{i}",
            interval=0.5,
            trainer_config=TrainerConfig(poll_hold_s=2, checkpoint_root=tmp_path / f"p{i}", statesync=SYNC),
            rollout_config=RolloutConfig(request_timeout_s=20, trainer_timeout_s=20, statesync=SYNC),
            device="cpu",
        )
        for i in range(3)
    ]
    trainer, a, b = runners
    try:
        for r in runners:
            await r.start()
        first = commit(1, Allocation.from_plain([[ids[0]]], spares=[ids[1], ids[2]]))
        await asyncio.gather(*(r.adopt(first, None) for r in runners))
        assert (trainer.role, a.role, b.role) == ("trainer", "rollout", "rollout")
        assert a.progress() is None and b.progress() is None  # rollout peers publish no record
        await wait(lambda: trainer.step >= 2, 120, "two iterations of epoch 1")

        # a re-plan: every peer stops where it is, then epoch 2 drops b
        for r in runners:
            await r.freeze("a rollout peer is suspected")
        assert trainer.held()[0].steps[-1] == trainer.step
        second = commit(2, Allocation.from_plain([[ids[0]]], spares=[ids[1]]))
        await asyncio.gather(*(r.adopt(second, None) for r in runners))
        assert b.role is None and not b.running
        await wait(lambda: trainer.state == TaskState.DONE, 120, "the trainer to finish epoch 2")
        await wait(lambda: a.state == TaskState.DONE, 30, "the rollout peer to hear that the job is done")

        sources = [r["source"] for r in trainer.recoveries]
        assert sources == ["init", "memory"]
        reports = trainer.reports
        assert [r.iteration for r in reports][-1] == ITERATIONS - 1 and reports[-1].version == ITERATIONS
        resumed = trainer.recoveries[1]["resume_step"]
        after = [r for r in reports if r.iteration >= resumed]
        assert after and all(r.shards == 1 and r.rollouts == 24 for r in after)  # a samples every prompt

        async def published() -> Any:
            return (await read_progress(dht.client(ids[1]), job.job_id)).get(ids[0])

        record = None
        for _ in range(40):
            record = await published()
            if record is not None and record.state == TaskState.DONE:
                break
            await asyncio.sleep(0.25)
        assert record is not None and (record.epoch, record.state, record.step) == (
            2,
            TaskState.DONE,
            ITERATIONS,
        )
        assert record.rl is not None and record.rl.version == ITERATIONS
        assert [i for i, _, _ in record.rl.rewards][-1] == ITERATIONS
        assert [s for s, _ in record.losses][-1] == ITERATIONS - 1 and record.rl.weight_sync_bytes > 0

        # checkpoints every 3 iterations, in the one-stage format, served for peerd fetch --p2p
        directory = checkpoint.tasklet_dir(tmp_path / "p0", job.job_id, 0, 0)
        assert checkpoint.saved_steps(directory)[-1] == ITERATIONS
        blob = trainer.provide(0, ITERATIONS)
        assert blob is not None
        check_checkpoint(blob, job.job_id, 0, ITERATIONS)
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_rl_runner_trains_across_a_replan(tmp_path: Path, async_wait_until: Any) -> None:
    asyncio.run(_scenario(tmp_path, async_wait_until))


async def _absent_device(tmp_path: Path) -> None:
    peers = await start_peers(2)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", SPEC, b"d" * 16, now=time.time(), epoch0_start=0.0, timing=SPEC.planning.timing()
    )
    runner = RLRunner(
        job,
        SPEC,
        store=MemoryDHT(time.time).client(ids[0]),
        transport=peers[0].transport,
        peer_ref=parse_peer_id,
        checkpoint_root=tmp_path,
        device="cuda:7",
    )
    try:
        await runner.adopt(commit(1, Allocation.from_plain([[ids[0]]], spares=[ids[1]])), None)
        assert runner.state == TaskState.FAILED and runner.reason.startswith("device:")
        assert not runner.running
    finally:
        await runner.close()
        await stop_peers(peers)


def test_a_device_this_peer_lacks_fails_the_role_naming_the_field(tmp_path: Path) -> None:
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    asyncio.run(_absent_device(tmp_path))


def runners_for(
    spec: JobSpec, job: Any, peers: list[Any], dht: MemoryDHT, tmp_path: Path, **options: Any
) -> list[RLRunner]:
    ids = [p.peer_id.to_base58() for p in peers]
    return [
        RLRunner(
            job,
            spec,
            store=dht.client(ids[i]),
            transport=peers[i].transport,
            peer_ref=parse_peer_id,
            checkpoint_root=tmp_path / f"p{i}",
            interval=0.2,
            trainer_config=TrainerConfig(poll_hold_s=2, checkpoint_root=tmp_path / f"p{i}", statesync=SYNC),
            rollout_config=RolloutConfig(request_timeout_s=20, trainer_timeout_s=20, statesync=SYNC),
            device="cpu",
            **{k: v(i) for k, v in options.items()},
        )
        for i in range(len(peers))
    ]


def entry(runner: RLRunner, epoch: int) -> RosterEntry:
    """``runner``'s peer applying for ``epoch`` with the trainer state it holds."""
    return RosterEntry(
        job=runner.job.job_id,
        epoch=epoch,
        peer=runner.me,
        issued_at=time.time(),
        profile=RosterDevice(tflops=1.0, memory_bytes=1 << 30),
        links=(),
        held=runner.held(),
    )


async def _trainer_lost(tmp_path: Path, wait: Any) -> None:
    iterations = 24
    spec = rl_spec(iterations)
    every = spec.checkpoint_interval
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", spec, b"t" * 16, now=time.time(), epoch0_start=0.0, timing=spec.planning.timing()
    )
    stores = [CheckpointReplicas(tmp_path / f"copies{i}", budget_bytes=1 << 30) for i in range(3)]
    runners = runners_for(spec, job, peers, dht, tmp_path, replicas=lambda i: stores[i])
    old, b, c = runners
    try:
        for r in runners:
            await r.start()
        first = commit(1, Allocation.from_plain([[ids[0]]], spares=[ids[1], ids[2]]))
        await asyncio.gather(*(r.adopt(first, None) for r in runners))
        # both rollout peers keep copies of the trainer's newest checkpoint; a loaded machine may see
        # the trainer pass a checkpoint before its copy is made, so any early one counts
        early = set(range(every, iterations // 2 + 1, every))
        await wait(
            lambda: all(early & set(s.steps(job.job_id, 0)) for s in stores[1:]),
            120,
            f"copies of one of the checkpoints {sorted(early)}",
        )
        # the trainer's peer dies; the others stop where they are and re-plan without it
        await old.close()
        await stop_peers(peers[:1])
        for r in (b, c):
            await r.freeze("the trainer is gone")
        roster = [entry(r, 2) for r in (b, c)]
        second = commit(2, Allocation.from_plain([[ids[1]]], spares=[ids[2]]))
        await asyncio.gather(*(r.adopt(second, roster) for r in (b, c)))
        assert (b.role, c.role) == ("trainer", "rollout")
        await wait(lambda: b.state == TaskState.DONE, 120, "the new trainer to finish")
        resumed = b.recoveries[-1]
        assert resumed["source"] == "replica"
        assert resumed["resume_step"] % every == 0 and every <= resumed["resume_step"] < iterations
        assert [r.iteration for r in b.reports] == list(range(resumed["resume_step"], iterations))
        assert b.reports[-1].version == iterations and b.step == iterations
        directory = checkpoint.tasklet_dir(tmp_path / "p1", job.job_id, 0, 0)
        assert checkpoint.saved_steps(directory)[-1] == iterations  # the new trainer checkpoints on
    finally:
        for r in (b, c):
            await r.close()
        await stop_peers(peers[1:])


def test_a_lost_trainer_is_replaced_from_a_rollout_peers_checkpoint_copy(
    tmp_path: Path, async_wait_until: Any
) -> None:
    asyncio.run(_trainer_lost(tmp_path, async_wait_until))


async def _roles_swapped(tmp_path: Path, wait: Any) -> None:
    spec = rl_spec(6)
    peers = await start_peers(2)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", spec, b"w" * 16, now=time.time(), epoch0_start=0.0, timing=spec.planning.timing()
    )
    a, b = runners_for(spec, job, peers, dht, tmp_path)
    try:
        for r in (a, b):
            await r.start()
        first = commit(1, Allocation.from_plain([[ids[0]]], spares=[ids[1]]))
        await asyncio.gather(*(r.adopt(first, None) for r in (a, b)))
        await wait(lambda: a.step >= 1, 120, "an iteration of epoch 1")
        for r in (a, b):
            await r.freeze("re-planned")
        held = a.held()[0].steps
        roster = [entry(r, 2) for r in (a, b)]
        second = commit(2, Allocation.from_plain([[ids[1]]], spares=[ids[0]]))
        await asyncio.gather(*(r.adopt(second, roster) for r in (a, b)))
        assert (a.role, b.role) == ("rollout", "trainer")
        await wait(lambda: b.state == TaskState.DONE, 120, "the new trainer to finish")
        resumed = b.recoveries[-1]
        # b had nothing: it fetched the policy a stopped with, from a's memory, over state sync
        assert resumed["source"] == f"peers {ids[0]}" and resumed["resume_step"] == max(held) >= 1
        assert [r.iteration for r in b.reports] == list(range(resumed["resume_step"], 6))
    finally:
        for r in (a, b):
            await r.close()
        await stop_peers(peers)


def test_a_new_trainer_fetches_the_policy_the_old_one_holds_in_memory(
    tmp_path: Path, async_wait_until: Any
) -> None:
    asyncio.run(_roles_swapped(tmp_path, async_wait_until))


async def _data_parallel_trainer_lost(tmp_path: Path, wait: Any) -> None:
    iterations = 40
    spec = dataclasses.replace(rl_spec(iterations), parallel=ParallelSpec(d_pp=1, d_dp=2))
    assert not spec.problems()
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", spec, b"d" * 16, now=time.time(), epoch0_start=0.0, timing=spec.planning.timing()
    )
    first_trainer, lost, rollout = runners = runners_for(spec, job, peers, dht, tmp_path)
    try:
        for r in runners:
            await r.start()
        first = commit(1, Allocation.from_plain([[ids[0], ids[1]]], spares=[ids[2]]))
        await asyncio.gather(*(r.adopt(first, None) for r in runners))
        assert (first_trainer.role, lost.role, rollout.role) == ("trainer", "trainer", "rollout")
        assert (first_trainer.replica, lost.replica) == (0, 1)
        await wait(lambda: first_trainer.step >= 4, 120, "a checkpoint and an iteration past it")
        # the second trainer's peer dies mid-job: the first stops averaging with it (within the
        # grace, not the group's timeout) and both survivors become the trainers of epoch 2
        await lost.close()
        await stop_peers(peers[1:2])
        # its average fails and its run ends on its own, before any re-plan reaches it
        await wait(lambda: not first_trainer.running, 120, "the first trainer to stop on the failed average")
        assert first_trainer.state == TaskState.RECOVERING, first_trainer.reason
        began = time.monotonic()
        for r in (first_trainer, rollout):
            await r.freeze("a trainer is gone")
        assert time.monotonic() - began < 60
        roster = [entry(r, 2) for r in (first_trainer, rollout)]
        second = commit(2, Allocation.from_plain([[ids[0], ids[2]]]))  # colocated: no rollout peer left
        await asyncio.gather(*(r.adopt(second, roster) for r in (first_trainer, rollout)))
        assert (first_trainer.role, rollout.role) == ("trainer", "trainer")
        await wait(
            lambda: first_trainer.state == rollout.state == TaskState.DONE, 180, "both trainers to finish"
        )
        # both resumed from the same version (the newest either declared) and ended bit-equal
        # (the first from its own checkpoint or memory, the other fetched it from the first)
        assert rollout.recoveries[-1]["source"] == f"peers {ids[0]}"
        steps = {r.recoveries[-1]["resume_step"] for r in (first_trainer, rollout)}
        assert len(steps) == 1 and 3 <= steps.pop() < iterations
        assert first_trainer.reports[-1].version == rollout.reports[-1].version == iterations
        policies = [
            checkpoint.load(checkpoint.tasklet_dir(tmp_path / p, job.job_id, 0, 0), iterations)["module"]
            for p in ("p0", "p2")
        ]
        assert all(torch.equal(policies[0][k], policies[1][k]) for k in policies[0])
    finally:
        for r in (first_trainer, rollout):
            await r.close()
        await stop_peers(peers[:1] + peers[2:])


def test_a_lost_data_parallel_trainer_is_replaced_and_the_replicas_stay_equal(
    tmp_path: Path, async_wait_until: Any
) -> None:
    asyncio.run(_data_parallel_trainer_lost(tmp_path, async_wait_until))
