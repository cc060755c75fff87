"""Pipeline streams under attack and faults over real p2pd: non-neighbours refused, malformed frames rejected
with typed codes and counted, corrupted transmissions retried (same curve), persistent faults fail every stage fast,
and a run cancelled at a random point leaves every stage with a whole step (step counter and weights agree)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from peerd.data.config import DataConfig, build_dataset
from peerd.errors import ErrorCode, ProtocolError
from peerd.models.gpt import GPT
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.deadlines import DeadlineConfig
from peerd.pipeline.frames import (
    KIND_ACT,
    KIND_GRAD,
    Hello,
    TensorMessage,
    control_header,
    part_header,
    raw_payload,
)
from peerd.pipeline.launch import (
    LocalPeer,
    Placement,
    RunResult,
    build_workers,
    run_workers,
    start_peers,
    stop_peers,
)
from peerd.pipeline.local import LocalRunConfig, optimizer_and_scheduler, train_pipelined
from peerd.pipeline.partition import partition
from peerd.pipeline.streams import StreamConfig, stage_protocol
from peerd.pipeline.worker import StageWorker
from peerd.swarm.framing import encode_frame
from peerd.swarm.transport import Transport

pytestmark = pytest.mark.integration

ALLOC = Placement([[0], [1]])  # peer 2 is in the swarm but not in the pipeline
CFG = TrainConfig(
    job="faults",
    model=ModelBuild("tiny"),
    data=DataConfig(seq_len=32, max_bytes=64 * 1024),
    layers_per_stage=[2, 2],
    global_batch=4,
    micro_batch_size=2,
    steps=6,
    lr=3e-3,
    streams=StreamConfig(recv_timeout_s=60, ack_timeout_s=60, stall_timeout_s=30, max_resends=2),
    device="cpu",  # the exactness bar is against the CPU reference (a GPU run has its own check)
)
SHAPE = (2, 32, 64)


class Swarm:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.peers: list[LocalPeer] = []

    def run(self, coro, timeout: float = 120.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def train(self, cfg: TrainConfig, prepare) -> tuple[RunResult, list[StageWorker]]:
        workers = build_workers(cfg, ALLOC, self.peers)
        return self.run(run_workers(workers, prepare=prepare)), workers


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    s = Swarm()
    try:
        s.peers = s.run(start_peers(3), timeout=90)
        yield s
    finally:
        s.run(stop_peers(s.peers), timeout=60)
        s.loop.close()


@pytest.fixture(scope="module")
def reference() -> list[float]:
    local = LocalRunConfig(steps=6, global_batch=4, micro_batch_size=2, layers_per_stage=[2, 2], lr=3e-3)
    return train_pipelined(GPT(CFG.model.gpt(), seed=0), build_dataset(CFG.data), local)


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def act_frame(stage1: StageWorker, job: str, **change) -> tuple[dict, bytes]:
    """A well-formed activation frame for stage 1's micro-batch 0 of step 0, with fields changed."""
    ids = stage1._ids_of(0, 0)
    assert ids is not None
    payload = bytes(raw_payload(torch.zeros(SHAPE)))
    msg = TensorMessage(KIND_ACT, job, 0, 0, 0, tuple(ids), "none", SHAPE, "float32", 1000, len(payload))
    return {**part_header(msg), **change}, payload


def test_non_neighbours_are_refused_and_malformed_frames_rejected_typed_and_counted(
    swarm, reference, async_wait_until
):
    cfg = dataclasses.replace(CFG, job="inject")
    a, b, outsider = swarm.peers
    seen: dict[str, object] = {}

    async def inject(workers: list[StageWorker]) -> None:
        _stage0, stage1 = workers
        header, payload = act_frame(stage1, cfg.job)

        async def first_reply(transport: Transport, target: LocalPeer, stage: int, frame) -> object:
            conn = await transport.connect(target.peer_id, stage_protocol(cfg.job, stage))
            try:
                await conn.send(control_header(Hello(0)))  # a stream opens by naming its epoch
                await conn.send(*frame)
                return (await conn.recv(timeout=10))[0]
            except ProtocolError as exc:
                return exc.code
            finally:
                await conn.close()

        # a peer outside the placement: refused by both stages before a frame is read
        seen["outsider->s1"] = await first_reply(outsider.transport, b, 1, (header, payload))
        seen["outsider->s0"] = await first_reply(outsider.transport, a, 0, (header, payload))
        # the downstream neighbour may only send gradients upstream
        as_b = Transport(b.p2p)
        seen["b sends acts to s0"] = await first_reply(as_b, a, 0, (header, payload))
        # the upstream neighbour's identity sending malformed activations
        as_a = Transport(a.p2p)
        bad = {
            "wrong shape": act_frame(stage1, cfg.job, shape=[2, 32, 65], nbytes=2 * 32 * 65 * 4),
            "wrong step": act_frame(stage1, cfg.job, step=3),
            "unknown example": act_frame(stage1, cfg.job, ids=[header["ids"][0], 10**6]),
            "truncated": (header, payload[: len(payload) // 2]),
        }
        bad["wrong shape"] = (bad["wrong shape"][0], bytes(2 * 32 * 65 * 4))
        for name, frame in bad.items():
            seen[name] = await first_reply(as_a, b, 1, frame)
        # a frame torn apart on the wire (the transport-level TRUNCATED): the stream is closed
        _info, _reader, writer = await a.p2p.call_binary_stream_handler(b.peer_id, stage_protocol(cfg.job, 1))
        writer.write(encode_frame(header, payload)[:3000])
        await writer.drain()
        writer.close()
        # the receiver counts the torn frame once it notices the stream end (no event to await)
        await async_wait_until(
            lambda: stage1.stats.rejected.get("TRUNCATED", 0) >= 2,
            60,
            "stage 1 to count the torn frame as its second TRUNCATED",
            detail=lambda: f"stage 1 rejected so far: {dict(stage1.stats.rejected)}",
        )
        await as_a.close()
        await as_b.close()

    result, _workers = swarm.train(cfg, inject)
    assert seen["outsider->s1"] == ErrorCode.NOT_ALLOWED and seen["outsider->s0"] == ErrorCode.NOT_ALLOWED
    nacks = {k: v for k, v in seen.items() if isinstance(v, dict)}
    assert {k: (v["kind"], v["code"]) for k, v in nacks.items()} == {
        "b sends acts to s0": ("pp.nack", ErrorCode.NOT_ALLOWED),
        "wrong shape": ("pp.nack", ErrorCode.SHAPE_MISMATCH),
        "wrong step": ("pp.nack", ErrorCode.WRONG_STEP),
        "unknown example": ("pp.nack", ErrorCode.UNKNOWN_EXAMPLE),
        "truncated": ("pp.nack", ErrorCode.TRUNCATED),
    }
    assert result.stats["s1r0"]["rejected"] == {
        "NOT_ALLOWED": 1,  # the outsider's stream
        "SHAPE_MISMATCH": 1,
        "WRONG_STEP": 1,
        "UNKNOWN_EXAMPLE": 1,
        "TRUNCATED": 2,
    }
    assert result.stats["s0r0"]["rejected"] == {"NOT_ALLOWED": 2}  # the outsider, acts from downstream
    assert result.stats["s1r0"]["refused"] == {"stranger": 1} == result.stats["s0r0"]["refused"]
    # none of it touched training
    assert result.ok, result.errors
    assert rel(result.losses(), reference) < 1e-4


def corrupt(header: dict, payload, how: str) -> tuple[dict, object]:
    if how == "shape":
        return {**header, "shape": [header["shape"][0], 31, 64]}, payload
    if how == "step":
        return {**header, "step": header["step"] + 5}, payload
    if how == "ids":
        return {**header, "ids": [10**6 + i for i in range(len(header["ids"]))]}, payload
    assert how == "truncate"
    return header, payload[: len(payload) - 100]


def test_corrupted_transmissions_are_retried_and_the_curve_is_unchanged(swarm, reference):
    cfg = dataclasses.replace(CFG, job="retry")
    plan = {1: "shape", 4: "step", 7: "ids", 10: "truncate"}  # activation seq -> first-attempt corruption

    def tamper_acts(msg, attempt, frames):
        how = plan.get(msg.seq)
        return [corrupt(*frames[0], how)] if how and attempt == 1 else frames

    def tamper_grads(msg, attempt, frames):
        return [corrupt(*frames[0], "step")] if msg.seq == 2 and attempt == 1 else frames

    def prepare(workers: list[StageWorker]) -> None:
        assert workers[0].to_next is not None and workers[1].to_prev is not None
        workers[0].to_next.tamper = tamper_acts
        workers[1].to_prev.tamper = tamper_grads

    result, _ = swarm.train(cfg, prepare)
    assert result.ok, result.errors
    assert rel(result.losses(), reference) < 1e-4
    assert result.stats["s1r0"]["rejected"] == {
        "SHAPE_MISMATCH": 1,
        "WRONG_STEP": 1,
        "UNKNOWN_EXAMPLE": 1,
        "TRUNCATED": 1,
    }
    assert result.stats["s0r0"]["rejected"] == {"WRONG_STEP": 1}
    assert result.stats["s0r0"]["resends"] >= 4 and result.stats["s1r0"]["resends"] >= 1


def test_a_persistent_fault_fails_every_stage_fast_with_typed_errors(swarm):
    cfg = dataclasses.replace(CFG, job="fail")

    def tamper(msg, attempt, frames):
        return [corrupt(*frames[0], "ids")] if msg.step >= 2 else frames

    def prepare(workers: list[StageWorker]) -> None:
        assert workers[0].to_next is not None
        workers[0].to_next.tamper = tamper

    result, _ = swarm.train(cfg, prepare)  # swarm.run's 120 s limit is only a hang guard
    assert sorted((e.stage, e.code) for e in result.errors) == [
        (0, "UNKNOWN_EXAMPLE"),
        (1, "UNKNOWN_EXAMPLE"),
    ]
    # stage 1 was told by stage 0's abort: had it waited out its 60 s recv timeout instead, its
    # error would be a TIMEOUT without "aborted"
    assert "aborted" in next(e for e in result.errors if e.stage == 1).message
    assert sorted({r.step for r in result.reports}) == [0, 1]
    # first try + 2 resends of seq 4; frames after it that left before the nack came back are
    # validated (and here rejected) too
    rejected = result.stats["s1r0"]["rejected"]
    assert set(rejected) == {"UNKNOWN_EXAMPLE"} and rejected["UNKNOWN_EXAMPLE"] >= 3


def test_the_wait_for_a_neighbour_follows_its_step_times(swarm, reference):
    """A pipeline of slow steps (~1 s on stage 1) has one much slower step (+3.5 s): longer than the
    3 s a stage waits in an epoch's first steps, but within 8 of the slowest steps seen, so stage 0
    waits for it (a fixed 3 s deadline broke this step) and the run ends on the reference curve."""
    streams = dataclasses.replace(
        CFG.streams, recv_timeout_s=3, deadlines=DeadlineConfig(factor=8.0, floor_s=1.0, warmup_steps=2)
    )
    cfg = dataclasses.replace(CFG, job="slow", streams=streams)

    def prepare(workers: list[StageWorker]) -> None:
        stage1 = workers[1]
        forward = stage1._forward

        def slow_forward(*args):
            time.sleep(3.5 if stage1.step == 4 and not slow_forward.done else 0.4)
            slow_forward.done = slow_forward.done or stage1.step == 4
            return forward(*args)

        slow_forward.done = False
        stage1._forward = slow_forward

    result, workers = swarm.train(cfg, prepare)
    assert result.errors == []
    assert rel(result.losses(), reference) < 1e-4
    assert workers[0].deadline.seconds() > 8 * 3.5  # learnt from its steps, the slow one included
    assert workers[0].ack_deadline.seconds() == workers[0].deadline.seconds()  # acks: the same rule


def test_grad_frames_are_checked_as_strictly(swarm, reference):
    """Stage 0 validates what its downstream neighbour sends back: the gradient stream is no weaker."""
    cfg = dataclasses.replace(CFG, job="grads")
    codes: list[object] = []

    async def inject(workers: list[StageWorker]) -> None:
        stage0, _ = workers
        a, b, _ = swarm.peers
        ids = stage0._ids_of(0, 0)
        payload = bytes(raw_payload(torch.zeros(SHAPE)))
        msg = TensorMessage(
            KIND_GRAD, cfg.job, 0, 0, 0, tuple(ids), "none", SHAPE, "float32", 77, len(payload)
        )
        as_b = Transport(b.p2p)
        conn = await as_b.connect(a.peer_id, stage_protocol(cfg.job, 0))
        await conn.send(control_header(Hello(0)))
        for change in ({"b": 1}, {"dtype": "float16", "nbytes": len(payload) // 2}, {"codec": "q8"}):
            body = payload[: change["nbytes"]] if "nbytes" in change else payload
            await conn.send({**part_header(msg), **change}, body)
            codes.append((await conn.recv(timeout=10))[0]["code"])
        await conn.close()
        await as_b.close()

    result, _ = swarm.train(cfg, inject)
    assert codes == [ErrorCode.MALFORMED, ErrorCode.DTYPE_MISMATCH, ErrorCode.UNKNOWN_CODEC]
    assert result.ok and rel(result.losses(), reference) < 1e-4


@pytest.fixture(scope="module")
def reference_weights() -> list[list[dict[str, torch.Tensor]]]:
    """``[step][stage]``: the single-process model's stage weights at the start of steps 0..CFG.steps."""
    model = GPT(CFG.model.gpt(), seed=0)
    dataset, stages = build_dataset(CFG.data), partition(model, CFG.layers_per_stage)
    local = LocalRunConfig(
        steps=1,
        global_batch=4,
        micro_batch_size=2,
        layers_per_stage=[2, 2],
        optimizer=CFG.optimizer,
        total_steps=CFG.steps,
    )
    optimizer, scheduler = optimizer_and_scheduler(list(model.parameters()), local, None, None)

    def weights() -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in st.state_dict().items()} for st in stages]

    out = [weights()]
    for step in range(CFG.steps):
        once = dataclasses.replace(local, start_step=step)
        train_pipelined(model, dataset, once, optimizer=optimizer, scheduler=scheduler)
        out.append(weights())
    return out


def weight_gap(module: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert module.keys() == ref.keys()
    return max((module[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_cancelled_run_leaves_whole_steps_that_resume_on_the_same_curve(
    swarm, reference, reference_weights, seed
):
    """Cancel both stages at a random moment of a random step; after ``quiesce`` each stage's step
    counter matches its weights, the stages are at most one update apart, rollback gives both the
    older step, and fresh workers loaded with it finish on the uninterrupted curve.

    Seed 0 holds stage 0 inside step 2's backward until the last stage has finished step 2, then
    cancels: the stages stop one update apart, and only rollback gives them a common step."""
    rng = random.Random(seed)
    cfg = dataclasses.replace(CFG, job=f"cancel{seed}", rollback=True)
    at_step, stage, fraction = rng.randrange(1, 5), rng.randrange(2), rng.random()
    if seed == 0:
        at_step, stage, fraction = 2, 1, 0.0
    tasks: list[asyncio.Task] = []
    held = threading.Event()

    def cancel_all() -> None:
        for t in tasks:
            t.cancel()
        held.set()

    def on_report(report) -> None:  # cancel a random fraction of a step time after a report
        if report.step == at_step and report.stage == stage and tasks:
            if fraction:
                asyncio.get_running_loop().call_later(fraction * report.step_s, cancel_all)
            else:
                cancel_all()

    async def cancelled() -> list[StageWorker]:
        workers = build_workers(cfg, ALLOC, swarm.peers, on_report=on_report)
        if seed == 0:  # stage 0's backward of step 2 (compute thread) waits for the cancel
            workers[0].inline_compute_s = 0.0  # held in the thread, not on the loop the cancel needs
            first = next(workers[0].module.parameters())
            first.register_hook(lambda g: (held.wait(60) if workers[0].step == at_step else None, g)[1])
        try:
            await asyncio.gather(*(w.start() for w in workers))
            await asyncio.gather(*(w.connect() for w in workers))
            tasks.extend(asyncio.ensure_future(w.run()) for w in workers)
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(w.quiesce() for w in workers))
        finally:
            await asyncio.gather(*(w.close() for w in workers))
        return workers

    workers = swarm.run(cancelled())
    steps = [w.step for w in workers]
    if seed == 0:
        assert steps == [at_step, at_step + 1]
    assert all(at_step <= s <= CFG.steps for s in steps) and max(steps) - min(steps) <= 1, steps
    for w in workers:  # the counter says which update the weights have had: never in between
        assert weight_gap(w.module.state_dict(), reference_weights[w.step][w.stage]) < 1e-6, (w.stage, w.step)
    common = min(steps)
    if common == CFG.steps:
        return  # the cancel came after the last step: nothing to resume
    states = []
    for w in workers:
        assert common in w.available_steps()
        state = w.state_at(common)
        assert weight_gap(state["module"], reference_weights[common][w.stage]) < 1e-6
        states.append(state)
    fresh = build_workers(cfg, ALLOC, swarm.peers)
    for w, state in zip(fresh, states, strict=True):
        assert w.load_state(state) == common
    result = swarm.run(run_workers(fresh))
    assert result.ok, result.errors
    assert rel(result.losses(), reference[common:]) < 1e-5
