"""Re-plans driven through real ``TaskletRunner``s on loopback p2p transports (records in an in-process store).

A re-plan as the job finishes: when a job re-plans at its final step (the wan bench's case:
one replica's last averaging was cut while the others had finished), every stage holds the
last step, so the new epoch resumes there. Such a tasklet has nothing to train: it must
write its final state and be ``done`` at once, without waiting for its partners to start the
epoch or opening streams to them (a partner that finished first has closed its streams; one
that never adopts the epoch would keep it ``running`` at step == steps, which no stall check
looks at). Epoch 1 trains the job to its end; epoch 2 re-plans the same allocation with a
roster that holds the last step; stage 0 adopts it while stage 1 never does: it is done
within seconds; then stage 1 adopts and is done too.

A hand-over of the last stage: its peer leaves mid-run and a spare takes its stage, loading
the state the leaving peer serves. Every step equals the single-process run's (bit for bit:
same thread count), and the successor's record carries the steps before the hand-over (the
curve its daemon remembered), so the job's curve keeps them once the leaver's record is gone.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.bench.churn import CHURN_SPEC
from peerd.data.config import build_dataset
from peerd.jobs import runner as runner_module
from peerd.jobs.catalog import read_progress
from peerd.jobs.records import TaskState, new_job_record
from peerd.jobs.runner import TaskletRunner, train_config
from peerd.jobs.spec import parse_job_spec
from peerd.jobs.store import MemoryDHT
from peerd.jobs.views import JobEntry, loss_curve, remember_curve
from peerd.models.gpt import GPT
from peerd.pipeline.launch import start_peers, stop_peers
from peerd.pipeline.local import LocalRunConfig, train_pipelined
from peerd.pipeline.replicas import CheckpointReplicas
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import RosterDevice, RosterEntry
from peerd.swarm.bans import Offence
from peerd.swarm.keys import progress_key
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


def entry_of(runner: TaskletRunner, epoch: int) -> RosterEntry:
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


def make_runners(
    spec: Any, peers: list[Any], dht: MemoryDHT, tmp_path: Path, *, copies: bool = False
) -> list[TaskletRunner]:
    """One runner per peer; ``copies``: each keeps checkpoint copies of the stages it is ranked for."""
    ids = [p.peer_id.to_base58() for p in peers]
    job = new_job_record(
        ids[0], "s", spec, b"n" * 16, now=time.time(), epoch0_start=0.0, timing=spec.planning.timing()
    )
    return [
        TaskletRunner(
            job,
            spec,
            store=dht.client(ids[i]),
            transport=peer.transport,
            peer_ref=parse_peer_id,
            checkpoint_root=tmp_path / f"p{i}",
            interval=0.5,
            ready_timeout=60.0,
            device="cpu",
            replicas=CheckpointReplicas(tmp_path / f"copies{i}", budget_bytes=1 << 30) if copies else None,
        )
        for i, peer in enumerate(peers)
    ]


async def _scenario(tmp_path: Path, wait: Any) -> None:
    peers = await start_peers(2)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    runners = make_runners(SPEC, peers, dht, tmp_path)
    job = runners[0].job
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

        roster = [entry_of(r, 2) for r in runners]
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


HANDOVER = parse_job_spec(
    {**CHURN_SPEC, "name": "handover", "steps": 60, "parallel": {"d_pp": 2, "d_dp": 1}, "min_peers": 2}
)


async def _handover(tmp_path: Path, wait: Any, leave_at: int) -> tuple[list[tuple[int, float]], int]:
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    first, last, spare = runners = make_runners(HANDOVER, peers, dht, tmp_path)
    job = first.job
    entry = JobEntry(job, HANDOVER)  # what the spare's daemon knows of the job
    try:
        for r in runners:
            await r.start()
        await asyncio.gather(
            *(
                r.adopt(commit(1, Allocation.from_plain([[ids[0]], [ids[1]]], [ids[2]])), None)
                for r in runners
            )
        )
        await wait(lambda: last.step >= leave_at, 120, f"step {leave_at}")
        await last.leave("its volunteer left")
        await first.freeze("re-planning: the last stage's peer left")
        # the spare's daemon reads the records while the job re-plans (the leaver's last one too)
        entry.progress = await read_progress(dht.client(ids[2]), job.job_id)
        remember_curve(entry)
        roster = [entry_of(r, 2) for r in runners]
        second = commit(2, Allocation.from_plain([[ids[0]], [ids[2]]]))
        history = sorted(entry.curve.items())
        await asyncio.gather(first.adopt(second, roster), spare.adopt(second, roster, history=history))
        resumed = spare.recoveries[-1]["resume_step"]
        assert spare.recoveries[-1]["source"].startswith("peer ")  # the leaving peer served its state
        await wait(lambda: first.state == spare.state == TaskState.DONE, 180, "the job to finish")
        await last.close()  # the leaver's daemon exits: its record goes (here: is dropped)
        dht.data[progress_key(job.job_id)].pop(ids[1])
        deadline = time.monotonic() + 30
        while True:  # the successor's last record (published within a heartbeat) says done
            records = await read_progress(dht.client(ids[0]), job.job_id)
            final = records.get(ids[2])
            if (final is not None and final.state == TaskState.DONE) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        return loss_curve(records.values(), last_stage=1), resumed
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_handed_over_last_stage_continues_the_curve_and_keeps_its_history(
    tmp_path: Path, async_wait_until: Any
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the runners and the reference compute alike
    try:
        curve, resumed = asyncio.run(_handover(tmp_path, async_wait_until, leave_at=20))
        cfg = train_config("ref", HANDOVER, Allocation.from_plain([["p0"], ["p1"]]), None)
        local = LocalRunConfig(
            steps=HANDOVER.steps,
            global_batch=cfg.global_batch,
            micro_batch_size=cfg.micro_batch_size,
            layers_per_stage=cfg.layers_per_stage,
            optimizer=cfg.optimizer,
            total_steps=cfg.steps,
        )
        reference = train_pipelined(GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data), local)
    finally:
        torch.set_num_threads(before)
    assert resumed >= 20
    assert [s for s, _ in curve] == list(range(HANDOVER.steps))  # nothing before the hand-over is lost
    assert [loss for _, loss in curve] == reference


async def _leave_outside_the_roster(tmp_path: Path, wait: Any) -> tuple[int, int]:
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    first, last, spare = runners = make_runners(HANDOVER, peers, dht, tmp_path, copies=True)
    try:
        for r in runners:
            await r.start()
        allocation = Allocation.from_plain([[ids[0]], [ids[1]]], [ids[2]])
        await asyncio.gather(*(r.adopt(commit(1, allocation), None) for r in runners))
        await wait(lambda: last.step >= 7, 120, "step 7")  # past a checkpoint (every 5), mid-interval
        await last.leave("its volunteer left")
        await asyncio.gather(first.freeze("re-planning"), spare.freeze("re-planning"))
        roster = [entry_of(r, 2) for r in (first, spare)]  # a leaving peer applies to no roster
        second = commit(2, Allocation.from_plain([[ids[0]], [ids[2]]]))
        await asyncio.gather(first.adopt(second, roster), spare.adopt(second, roster))
        await wait(lambda: first.state == spare.state == TaskState.DONE, 180, "the job to finish")
        return spare.recoveries[-1]["resume_step"], last.step
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_leaving_peer_outside_the_roster_hands_over_through_the_copies_the_re_plan_makes(
    tmp_path: Path, async_wait_until: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CI failure of 2026-12-04: a one-replica stage's peer left, and the survivors' roster
    entries were read 30 ms before their periodic copy of its last state; the job fell back 100
    steps to an older checkpoint. Here the periodic copy never runs: only the pass ``freeze``
    makes before the re-plan can carry the leaver's state, at the exact step it stopped at."""
    monkeypatch.setattr(runner_module, "REPLICATE_POLL_S", 3600.0)
    resumed, left_at = asyncio.run(_leave_outside_the_roster(tmp_path, async_wait_until))
    assert left_at >= 7 and resumed == left_at


async def _ban(tmp_path: Path, wait: Any) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]:
    spec = parse_job_spec(
        {**CHURN_SPEC, "name": "ban", "steps": 2000, "parallel": {"d_pp": 3, "d_dp": 1}, "min_peers": 3}
    )
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    runners = make_runners(spec, peers, dht, tmp_path)
    middle = runners[1]
    try:
        for r in runners:
            await r.start()
        allocation = Allocation.from_plain([[ids[0]], [ids[1]], [ids[2]]])
        await asyncio.gather(*(r.adopt(commit(1, allocation), None) for r in runners))
        await wait(lambda: middle.step >= 2, 120, "the pipeline to train")
        before = middle.suspects
        for _ in range(3):  # three garbage streams from the last stage's peer ban it (BanPolicy)
            peers[1].transport.banlist.report(peers[2].peer_id, Offence.GARBAGE, "test: undecodable frame")
        running = middle.suspects  # named while the tasklet still runs (open streams go on)
        await runners[2].close()  # the banned partner's streams end: the middle tasklet's step breaks
        await wait(lambda: middle.state == TaskState.RECOVERING, 120, "the middle tasklet to stop")
        return before, running, middle.suspects, ids[2]
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_partner_banned_by_the_transport_is_the_one_suspected(
    tmp_path: Path, async_wait_until: Any
) -> None:
    """The middle stage's transport bans the last stage's peer (three garbage streams, reported as
    the transport reports them): the middle tasklet suspects that partner at once, and when its step
    breaks (here: the banned peer goes) its record names only that one, not the first stage's peer
    too (before: every partner of a broken tasklet was suspected)."""
    before, running, broken, banned = asyncio.run(_ban(tmp_path, async_wait_until))
    assert before == ()
    assert running == (banned,)
    assert broken == (banned,)


async def _out_of_memory(tmp_path: Path, wait: Any, at_step: int) -> tuple[list[tuple[int, float]], Any, int]:
    """The last stage's peer runs out of memory at ``at_step``: it hands its stage over like a leave."""
    peers = await start_peers(3)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    first, last, spare = runners = make_runners(HANDOVER, peers, dht, tmp_path)
    job = first.job
    entry = JobEntry(job, HANDOVER)
    try:
        for r in runners:
            await r.start()
        allocation = Allocation.from_plain([[ids[0]], [ids[1]]], [ids[2]])
        await asyncio.gather(*(r.adopt(commit(1, allocation), None) for r in runners))
        await wait(lambda: last.state == TaskState.LEFT, 120, "the out-of-memory hand-over")
        published = (await read_progress(dht.client(ids[0]), job.job_id))[ids[1]]
        for _ in range(120):  # the state changes before its record is stored (the next heartbeat)
            if published.state == TaskState.LEFT:
                break
            await asyncio.sleep(0.25)
            published = (await read_progress(dht.client(ids[0]), job.job_id))[ids[1]]
        await first.freeze("re-planning: the last stage's peer handed its stage over")
        entry.progress = await read_progress(dht.client(ids[2]), job.job_id)
        remember_curve(entry)
        roster = [entry_of(r, 2) for r in runners]
        second = commit(2, Allocation.from_plain([[ids[0]], [ids[2]]]))
        history = sorted(entry.curve.items())
        await asyncio.gather(first.adopt(second, roster), spare.adopt(second, roster, history=history))
        assert spare.recoveries[-1]["source"] == f"peer {ids[1]}"  # the state the unfit peer still serves
        await wait(lambda: first.state == spare.state == TaskState.DONE, 180, "the job to finish")
        assert last.unfit is not None and last.state == TaskState.LEFT  # it stays out of this job
        records = await read_progress(dht.client(ids[0]), job.job_id)
        for _ in range(120):  # the successor's final record (within a heartbeat)
            if records[ids[2]].state == TaskState.DONE:
                break
            await asyncio.sleep(0.25)
            records = await read_progress(dht.client(ids[0]), job.job_id)
        records.pop(ids[1])  # the unfit peer's record expires in time; the curve must not need it
        return loss_curve(records.values(), last_stage=1), published, spare.recoveries[-1]["resume_step"]
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_stage_out_of_memory_is_handed_over_and_the_job_finishes_on_the_same_curve(
    tmp_path: Path, async_wait_until: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of the last stage raises torch's OutOfMemoryError (injected into the real worker: this
    machine has no device to fill). The tasklet publishes ``left`` with the numbers as its reason,
    keeps serving its last state, and the spare takes the stage from it in the next epoch: the job
    finishes on the single-process curve, no step lost, and the daemon's runner never crashes."""
    from peerd.pipeline.worker import StageWorker

    at_step, raised = 20, []
    forward = StageWorker._forward

    def failing_forward(self: StageWorker, *args: Any) -> Any:
        if self.last and self.step == at_step and not raised:
            raised.append(self.step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(self, *args)

    monkeypatch.setattr(StageWorker, "_forward", failing_forward)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        curve, published, resumed = asyncio.run(_out_of_memory(tmp_path, async_wait_until, at_step))
        cfg = train_config("ref", HANDOVER, Allocation.from_plain([["p0"], ["p1"]]), None)
        local = LocalRunConfig(
            steps=HANDOVER.steps,
            global_batch=cfg.global_batch,
            micro_batch_size=cfg.micro_batch_size,
            layers_per_stage=cfg.layers_per_stage,
            optimizer=cfg.optimizer,
            total_steps=cfg.steps,
        )
        reference = train_pipelined(GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data), local)
    finally:
        torch.set_num_threads(before)
    assert raised == [at_step]
    assert published.state == TaskState.LEFT
    assert "out of memory on cpu in stage 1 step 20: requested 2.00 GiB, free" in published.reason
    assert resumed == at_step  # the last finished step: nothing is lost
    assert [s for s, _ in curve] == list(range(HANDOVER.steps))
    assert [loss for _, loss in curve] == reference


async def _disk_full(tmp_path: Path, wait: Any) -> tuple[TaskletRunner, int, list[Any]]:
    """The last stage's checkpoint write fails (ENOSPC); both peers re-plan into the same allocation."""
    peers = await start_peers(2)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    runners = make_runners(HANDOVER, peers, dht, tmp_path)
    first, last = runners
    allocation = Allocation.from_plain([[ids[0]], [ids[1]]])
    try:
        for r in runners:
            await r.start()
        await asyncio.gather(*(r.adopt(commit(1, allocation), None) for r in runners))
        await wait(lambda: last.worker is not None and last.worker.closed, 120, "the failed save")
        stopped = (last.state, last.suspects, last.reason)
        await wait(lambda: first.state == TaskState.RECOVERING, 20, "the first stage to hear of it")
        assert "stage 1 stopped: OSError on this peer" in first.reason
        for r in runners:
            await r.freeze("re-planning: the last stage's tasklet is stuck")
        roster = [entry_of(r, 2) for r in runners]
        await asyncio.gather(*(r.adopt(commit(2, allocation), roster) for r in runners))
        await wait(lambda: all(r.state == TaskState.DONE for r in runners), 180, "the job to finish")
        return last, last.recoveries[-1]["resume_step"], list(stopped)
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_local_disk_error_stops_the_tasklet_for_a_re_plan_and_does_not_fail_the_job(
    tmp_path: Path, async_wait_until: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint write of the last stage fails with ENOSPC at step 10 (injected into the real
    worker's save). It is this machine's trouble, not a partner's and not a bug: the tasklet
    publishes ``recovering`` with the error as its reason and suspects no partner (before, the
    tasklet was ``failed`` and took the whole job with it). The re-plan resumes it, and the job
    trains to its end. Its neighbour hears of the stop at once instead of waiting out its
    receive timeout."""
    from peerd.pipeline import checkpoint

    save, raised = checkpoint.save, []

    def failing_save(directory: Any, state: dict[str, Any], *args: Any) -> Any:
        if state["stage"] == 1 and state["step"] == 10 and not raised:
            raised.append(state["step"])
            raise OSError(28, "No space left on device")
        return save(directory, state, *args)

    monkeypatch.setattr(checkpoint, "save", failing_save)
    last, resumed, (state, suspects, reason) = asyncio.run(_disk_full(tmp_path, async_wait_until))
    assert raised == [10]
    assert (state, suspects) == (TaskState.RECOVERING, ())
    assert reason == "OSError on this peer: [Errno 28] No space left on device"
    assert 5 <= resumed <= 10  # the frozen live step, or at worst the last checkpoint
    assert last.step == HANDOVER.steps


async def _stopped_while_starting(tmp_path: Path, wait: Any) -> tuple[list[Any], list[Any]]:
    """Stage 0's tasklet of epoch 1 is stopped by a re-plan while its p2pd registers the stage protocol."""
    peers = await start_peers(2)
    dht = MemoryDHT(time.time)
    ids = [p.peer_id.to_base58() for p in peers]
    runners = make_runners(SPEC, peers, dht, tmp_path)
    first = runners[0]
    p2p = peers[0].p2p
    add, registering = p2p.add_binary_stream_handler, asyncio.Event()

    async def slow_add(protocol: str, *args: Any, **kwargs: Any) -> Any:
        await add(protocol, *args, **kwargs)
        if "/pp/" in protocol and not registering.is_set():
            registering.set()
            await asyncio.sleep(30)  # p2pd holds the handler; serve() has not returned

    p2p.add_binary_stream_handler = slow_add  # type: ignore[method-assign]
    allocation = Allocation.from_plain([[ids[0]], [ids[1]]])
    try:
        for r in runners:
            await r.start()
        await first.adopt(commit(1, allocation), None)
        await registering.wait()
        await first.freeze("re-planning: a newcomer can add a replica")  # cancels the starting tasklet
        stopped = [first.state, first.reason]
        await asyncio.gather(*(r.adopt(commit(2, allocation), None) for r in runners))
        ended = (TaskState.DONE, TaskState.FAILED)
        await wait(lambda: all(r.state in ended for r in runners), 120, "epoch 2 to end")
        return stopped, [(r.state, r.step) for r in runners]
    finally:
        for r in runners:
            await r.close()
        await stop_peers(peers)


def test_a_tasklet_stopped_while_it_registers_its_protocol_runs_the_next_epoch(
    tmp_path: Path, async_wait_until: Any
) -> None:
    """The CI sequence of `test_growth`'s failure: a re-plan stopped a tasklet 17 ms after it began,
    while p2pd was taking its stage protocol's handler. The protocol stayed "served" with no worker
    to stop it, and the next epoch's tasklet failed the job: "'peerd/pp/1/<job>/s0' is already
    served". Now the next epoch's tasklet serves the protocol again and the job trains to its end."""
    stopped, ended = asyncio.run(_stopped_while_starting(tmp_path, async_wait_until))
    assert stopped[0] == TaskState.RECOVERING, stopped
    assert ended == [(TaskState.DONE, SPEC.steps)] * 2
