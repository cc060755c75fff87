"""Pipeline streams under attack and faults over real p2pd: non-neighbours refused, malformed frames rejected
with typed codes and counted, corrupted transmissions retried (same curve), persistent faults fail every stage fast."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from peerd.data.config import DataConfig, build_dataset
from peerd.errors import ErrorCode, ProtocolError
from peerd.models.gpt import GPT
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.frames import KIND_ACT, KIND_GRAD, TensorMessage, part_header, raw_payload
from peerd.pipeline.launch import (
    LocalPeer,
    Placement,
    RunResult,
    build_workers,
    run_workers,
    start_peers,
    stop_peers,
)
from peerd.pipeline.local import LocalRunConfig, train_pipelined
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
        "SHAPE_MISMATCH": 1,
        "WRONG_STEP": 1,
        "UNKNOWN_EXAMPLE": 1,
        "TRUNCATED": 2,
    }
    assert result.stats["s0r0"]["rejected"] == {"NOT_ALLOWED": 1}
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
        for change in ({"b": 1}, {"dtype": "float16", "nbytes": len(payload) // 2}, {"codec": "q8"}):
            body = payload[: change["nbytes"]] if "nbytes" in change else payload
            await conn.send({**part_header(msg), **change}, body)
            codes.append((await conn.recv(timeout=10))[0]["code"])
        await conn.close()
        await as_b.close()

    result, _ = swarm.train(cfg, inject)
    assert codes == [ErrorCode.MALFORMED, ErrorCode.DTYPE_MISMATCH, ErrorCode.UNKNOWN_CODEC]
    assert result.ok and rel(result.losses(), reference) < 1e-4
