"""A re-plan as the job finishes: tasklets that resume at the last step finish, they do not wait.

When a job re-plans at its final step (the wan bench's case: one replica's last averaging
was cut while the others had finished), every stage holds the last step, so the new epoch
resumes there. Such a tasklet has nothing to train: it must write its final state and be
``done`` at once, without waiting for its partners to start the epoch or opening streams
to them (a partner that finished first has closed its streams; one that never adopts the
epoch would keep it ``running`` at step == steps, which no stall check looks at).

Two real ``TaskletRunner``s (stage 0 and stage 1) on loopback p2p transports, their records
in an in-process store: epoch 1 trains the job to its end; epoch 2 re-plans the same
allocation with a roster that holds the last step. Stage 0 adopts epoch 2 while stage 1
never does: it is done within seconds; then stage 1 adopts and is done too.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from peerd.jobs.catalog import read_progress
from peerd.jobs.records import TaskState, new_job_record
from peerd.jobs.runner import TaskletRunner
from peerd.jobs.spec import parse_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.pipeline.launch import start_peers, stop_peers
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import RosterDevice, RosterEntry
from peerd.swarm.node import parse_peer_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SPEC = parse_job_spec(
    {
        "name": "final",
        "kind": "pretrain",
        "model": {"preset": "tiny", "seed": 0},
        "data": {"source": "builtin", "seq_len": 16, "max_bytes": 16384},
        "steps": 4,
        "global_batch": 4,
        "micro_batch": 2,
        "parallel": {"d_pp": 2, "d_dp": 1},
        "min_peers": 2,
        "checkpoint_interval": 2,
    }
)


def commit(epoch: int, allocation: Allocation) -> Commit:
    """What the runner reads of a commit: its epoch and allocation (the proof is the planner's business)."""
    return Commit(epoch, 0, allocation, "00" * 32, "00" * 32, 1.0, record=None)  # type: ignore[arg-type]


def entry(runner: TaskletRunner, epoch: int) -> RosterEntry:
    """``runner``'s peer applying for ``epoch`` with the stage state it holds."""
    return RosterEntry(
        job=runner.job.job_id,
        epoch=epoch,
        peer=runner.me,
        issued_at=time.time(),
        profile=RosterDevice(tflops=1.0, memory_bytes=1 << 30),
        links=(),
        held=runner.held(),
    )


async def _scenario(tmp_path: Path, wait: Any) -> None:
    peers = await start_peers(2)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", SPEC, b"n" * 16, now=time.time(), epoch0_start=0.0, timing=SPEC.planning.timing()
    )
    runners = [
        TaskletRunner(
            job,
            SPEC,
            store=dht.client(ids[i]),
            transport=peers[i].transport,
            peer_ref=parse_peer_id,
            checkpoint_root=tmp_path / f"p{i}",
            interval=0.5,
            ready_timeout=60.0,
            device="cpu",
        )
        for i in range(2)
    ]
    try:
        for r in runners:
            await r.start()
        allocation = Allocation.from_plain([[ids[0]], [ids[1]]])
        first = commit(1, allocation)
        await asyncio.gather(*(r.adopt(first, None) for r in runners))
        await wait(
            lambda: all(r.state == TaskState.DONE for r in runners), 120, "epoch 1 to train to the end"
        )
        assert [r.step for r in runners] == [SPEC.steps] * 2

        roster = [entry(r, 2) for r in runners]
        assert all(SPEC.steps in h.steps for e in roster for h in e.held)  # both stages hold the last step
        second = commit(2, allocation)
        lone, late = runners
        await lone.adopt(second, roster)  # its partner has not adopted epoch 2 (and may never)

        async def published() -> dict[str, Any]:
            return await read_progress(dht.client(ids[0]), job.job_id)

        await wait(lambda: lone.state == TaskState.DONE, 15, "the lone tasklet at the last step to finish")
        assert lone.recoveries[-1]["epoch"] == 2 and lone.recoveries[-1]["resume_step"] == SPEC.steps
        await late.adopt(second, roster)
        await wait(lambda: late.state == TaskState.DONE, 15, "the late tasklet at the last step to finish")
        for _ in range(40):  # the records of epoch 2 say done, at the last step
            records = await published()
            if (
                all(p.epoch == 2 and p.state == TaskState.DONE for p in records.values())
                and len(records) == 2
            ):
                break
            await asyncio.sleep(0.25)
        assert {(p.epoch, p.state, p.step) for p in records.values()} == {(2, TaskState.DONE, SPEC.steps)}
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_tasklets_resuming_at_the_last_step_finish_without_their_partners(
    tmp_path: Path, async_wait_until: Any
) -> None:
    asyncio.run(_scenario(tmp_path, async_wait_until))
