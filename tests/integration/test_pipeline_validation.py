"""The validation split over real p2pd on loopback: the pipeline's held-out loss is the single-process one.

2 stages x 2 replicas, uncompressed: at every evaluation step the mean of the last stage's replica
held-out losses equals the held-out loss of the same model trained in one process, evaluated on
the same windows (within 1e-4), and the training curve is still the reference's. 3 stages x 1
replica with AC-SGD (fw 4 bit, bw 8 bit): the middle stage forwards the held-out activations, the
training curve is bit-identical to the same run evaluated only after its last step (no optimizer
state, schedule or AC-SGD buffer was touched by the evaluations in between, checkpoints holding
the receivers' decoding included), and the final held-out loss equals a one-process evaluation of the
workers' own trained layers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peerd.bench.pipeline import group_allreduce
from peerd.data.config import DataConfig, build_dataset
from peerd.data.validation import ValidationConfig
from peerd.models.gpt import GPT, lm_loss
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.launch import (
    LocalPeer,
    Placement,
    RunResult,
    build_workers,
    run_workers,
    start_peers,
    stop_peers,
)
from peerd.pipeline.local import LocalRunConfig, optimizer_and_scheduler, train_unstaged
from peerd.pipeline.streams import StreamConfig
from peerd.pipeline.worker import StageWorker

pytestmark = pytest.mark.integration

VALIDATION = ValidationConfig(windows=40, interval=3, batches=2)
CFG = TrainConfig(
    job="val",
    model=ModelBuild("tiny"),  # layers: emb, blk, blk, head
    data=DataConfig(seq_len=32, max_bytes=64 * 1024, validation=VALIDATION),
    layers_per_stage=[2, 2],
    global_batch=8,
    micro_batch_size=2,
    steps=7,  # evaluations after steps 3, 6 and 7 (the last)
    lr=3e-3,
    streams=StreamConfig(recv_timeout_s=60, ack_timeout_s=60, stall_timeout_s=30),
    averaging_timeout_s=60,
    device="cpu",
)
EVALUATED = [3, 6, 7]


class Cluster:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.peers: list[LocalPeer] = []

    def run(self, cfg: TrainConfig, placement: Placement) -> tuple[RunResult, list[StageWorker]]:
        workers = build_workers(cfg, placement, self.peers, reducer_factory=group_allreduce)
        coro = asyncio.wait_for(run_workers(workers), 180)
        return self.loop.run_until_complete(coro), workers


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.peers = c.loop.run_until_complete(asyncio.wait_for(start_peers(4), 90))
        yield c
    finally:
        c.loop.run_until_complete(asyncio.wait_for(stop_peers(c.peers), 60))
        c.loop.close()


def val_curve(result: RunResult) -> list[tuple[int, float]]:
    """(steps completed, mean over the last stage's replicas of their held-out loss)."""
    by_step: dict[int, list[float]] = {}
    for r in result.reports:
        if r.val_loss is not None:
            by_step.setdefault(r.step + 1, []).append(r.val_loss)
    return [(k, sum(v) / len(v)) for k, v in sorted(by_step.items())]


def held_out_batch(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = build_dataset(cfg.data)
    ids = list(dataset.held_out_ids())[: VALIDATION.batches * cfg.global_batch]
    return dataset.batch(ids)


@torch.no_grad()
def evaluate(model: torch.nn.Module, cfg: TrainConfig) -> float:
    x, y = held_out_batch(cfg)
    model.eval()
    try:
        return lm_loss(model(x), y).item()
    finally:
        model.train()


def reference_val(cfg: TrainConfig, replicas: int) -> tuple[list[float], list[tuple[int, float]]]:
    """The job in one process (unstaged, full batches): its training curve and held-out loss after each evaluated step."""
    model = GPT(cfg.model.gpt(), seed=cfg.model.seed)
    dataset = build_dataset(cfg.data)
    local = LocalRunConfig(
        steps=cfg.steps,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.global_batch,
        replicas=replicas,
        optimizer=cfg.optimizer,
        total_steps=cfg.steps,
    )
    optimizer, scheduler = optimizer_and_scheduler(list(model.parameters()), local, None, None)
    losses: list[float] = []
    points = []
    done = 0
    for k in EVALUATED:
        segment = dataclasses.replace(local, start_step=done, steps=k - done)
        losses += train_unstaged(model, dataset, segment, optimizer, scheduler)
        points.append((k, evaluate(model, cfg)))
        done = k
    return losses, points


def test_held_out_loss_of_two_stages_by_two_replicas_equals_one_process(cluster: Cluster) -> None:
    result, _ = cluster.run(CFG, Placement.grid(2, 2))
    assert result.ok, result.errors
    losses, points = reference_val(CFG, replicas=2)
    got = val_curve(result)
    assert [k for k, _ in got] == EVALUATED, got
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, points, strict=True)) < 1e-4, (got, points)
    assert max(abs(a - b) for a, b in zip(result.losses(), losses, strict=True)) < 1e-4
    # held-out activations crossed boundary 0, raw and accepted: nothing was rejected or resent
    for name, stats in result.stats.items():
        assert not stats["rejected"] and stats["resends"] == 0, name
    # held-out activations are counted apart from training traffic: 3 evaluations x 8 windows
    # x (32 x 64) fp32 per replica, plus frame headers
    for name in ("s0r0", "s0r1"):
        wire = result.stats[name]["wire_bytes"]
        assert 3 * 8 * 32 * 64 * 4 < wire["b0.val.sent"] < 3 * 8 * 32 * 64 * 4 + 12 * 1024, wire
        assert wire["b0.fwd.sent"] > 0
    # only the last stage reports a held-out loss
    assert {r.stage for r in result.reports if r.val_loss is not None} == {1}


def test_a_middle_stage_forwards_held_out_batches_and_ac_sgd_is_untouched(
    cluster: Cluster, tmp_path: Path
) -> None:
    acsgd = CompressionConfig(forward="acsgd", forward_bits=4, backward_bits=8)
    # checkpoints after every other step: receivers hold AC-SGD decoding of the next step meanwhile
    cfg = dataclasses.replace(
        CFG,
        job="val3",
        layers_per_stage=[1, 2, 1],
        compression=acsgd,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=2,
    )
    # the same split, evaluated only after the last step: steps 3 to 6 follow no evaluation
    once = dataclasses.replace(VALIDATION, interval=1000)
    plain = dataclasses.replace(cfg, job="plain3", data=dataclasses.replace(cfg.data, validation=once))
    placement = Placement.grid(3, 1)
    with_val, workers = cluster.run(cfg, placement)
    without, _ = cluster.run(plain, placement)
    assert with_val.ok and without.ok, (with_val.errors, without.errors)
    assert with_val.losses() == without.losses()  # bit for bit: evaluations changed nothing
    assert [k for k, _ in val_curve(without)] == [7]
    got = val_curve(with_val)
    assert [k for k, _ in got] == EVALUATED, got
    # the workers' own trained layers, put together in one process, give the last held-out loss
    model = GPT(cfg.model.gpt(), seed=cfg.model.seed)
    state = {}
    for w in sorted(workers, key=lambda w: w.stage):
        offset = w.module.spec.start
        for name, t in w.module.layers.state_dict().items():
            index, rest = name.split(".", 1)
            state[f"{int(index) + offset}.{rest}"] = t
    model.layers.load_state_dict(state)
    assert abs(got[-1][1] - evaluate(model, cfg)) < 1e-4, (got, evaluate(model, cfg))


def test_one_stage_replicas_evaluate_their_shards_without_frames(cluster: Cluster) -> None:
    cfg = dataclasses.replace(CFG, job="val1", layers_per_stage=[4])
    result, _ = cluster.run(cfg, Placement([[0, 1]]))
    assert result.ok, result.errors
    _, points = reference_val(cfg, replicas=2)
    got = val_curve(result)
    assert [k for k, _ in got] == EVALUATED, got
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, points, strict=True)) < 1e-4, (got, points)
    assert all(not any(".val." in k for k in stats["wire_bytes"]) for stats in result.stats.values())
