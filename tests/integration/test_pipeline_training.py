"""Pipeline training over real p2pd on loopback: 2 stages x 2 replicas match the single-process reference,
1F1B == GPipe, AC-SGD fw4/bw8 + 8-bit gradients stay within 3 %, and a killed run resumes from checkpoints
(uncompressed, and AC-SGD with its buffers: the same curve, sender and receiver buffers bit-identical), and
one replica's rollback state, loaded into fresh workers of both replicas, continues the uninterrupted curve."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peerd.bench.pipeline import group_allreduce
from peerd.data.config import DataConfig, build_dataset
from peerd.models.gpt import GPT
from peerd.pipeline import checkpoint
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.launch import (
    LocalPeer,
    Placement,
    RunResult,
    build_workers,
    run_allocation,
    run_workers,
    start_peers,
    stop_peers,
)
from peerd.pipeline.local import LocalRunConfig, train_pipelined, train_unstaged
from peerd.pipeline.optim import OptimizerConfig
from peerd.pipeline.streams import StreamConfig
from peerd.pipeline.worker import PHASES, StepReport

pytestmark = pytest.mark.integration

STAGES, REPLICAS = 2, 2
CFG = TrainConfig(
    job="exact",
    model=ModelBuild("tiny"),  # 2 blocks, d_model 64: layers [emb, blk] | [blk, head]
    data=DataConfig(seq_len=32, max_bytes=64 * 1024),
    layers_per_stage=[2, 2],
    global_batch=8,
    micro_batch_size=2,
    steps=20,
    lr=3e-3,
    streams=StreamConfig(recv_timeout_s=60, ack_timeout_s=60, stall_timeout_s=30),
    averaging_timeout_s=60,
    device="cpu",  # the exactness bar is against the CPU reference (a GPU run has its own check)
)


class Cluster:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.peers: list[LocalPeer] = []
        self.curves: dict[str, list[float]] = {}

    def run(self, coro, timeout: float = 120.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def train(self, cfg: TrainConfig, **kw) -> RunResult:
        placement = Placement.grid(STAGES, REPLICAS)
        return self.run(run_allocation(cfg, placement, self.peers, reducer_factory=group_allreduce, **kw))

    def kill_after(self, cfg: TrainConfig, step: int) -> None:
        """Train ``cfg`` and stop every peer abruptly once step ``step`` is reported (no clean shutdown)."""

        async def killed() -> None:
            task: asyncio.Task | None = None

            def on_report(report: StepReport) -> None:
                if report.step == step and task is not None:
                    task.cancel()

            placement = Placement.grid(STAGES, REPLICAS)
            task = asyncio.ensure_future(
                run_allocation(
                    cfg, placement, self.peers, reducer_factory=group_allreduce, on_report=on_report
                )
            )
            with pytest.raises(asyncio.CancelledError):
                await task

        self.run(killed())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.peers = c.run(start_peers(STAGES * REPLICAS), timeout=90)
        yield c
    finally:
        c.run(stop_peers(c.peers), timeout=60)
        c.loop.close()


def reference(cfg: TrainConfig, steps: int | None = None) -> list[float]:
    local = LocalRunConfig(
        steps=steps or cfg.steps,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        layers_per_stage=cfg.layers_per_stage,
        replicas=REPLICAS,
        schedule=cfg.schedule,
        optimizer=cfg.optimizer,
        total_steps=cfg.steps,
    )
    return train_pipelined(GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data), local)


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_four_peers_reproduce_the_single_process_run(cluster: Cluster):
    result = cluster.train(CFG)
    assert result.ok, result.errors
    losses = result.losses()
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5
    assert rel(losses, reference(CFG)) < 1e-4
    # the same model, seed and global batch trained whole (no stages, no micro-batches)
    unstaged = train_unstaged(
        GPT(CFG.model.gpt(), seed=0),
        build_dataset(CFG.data),
        LocalRunConfig(
            steps=20, global_batch=8, micro_batch_size=8, replicas=REPLICAS, optimizer=CFG.optimizer
        ),
    )
    assert rel(losses, unstaged) < 1e-4
    cluster.curves["1f1b"] = losses
    # every tasklet reported every step; bytes crossed boundary 0 both ways, none were rejected
    assert len(result.reports) == 20 * 4
    for name, stats in result.stats.items():
        assert not stats["rejected"] and stats["resends"] == 0, name
    step = next(r for r in result.reports if r.step == 5 and r.stage == 0)
    acts_bytes = 4 * 32 * 64 * 4  # a replica's 4 examples x 32 tokens x 64 channels, fp32
    assert acts_bytes < step.wire_bytes["b0.fwd.sent"] < acts_bytes * 1.05
    assert step.wire_bytes["b0.bwd.received"] > acts_bytes
    # each step's time is split into its phases, whole: the bench reads the regime from them
    for r in result.reports:
        assert set(r.phases_s) == set(PHASES) and min(r.phases_s.values()) >= 0
        assert sum(r.phases_s.values()) == pytest.approx(r.step_s, rel=0.01, abs=1e-3)
        assert r.phases_s["compute"] > 0 and r.phases_s["averaging"] > 0  # 2 replicas average
        assert r.phases_s["averaging_wait"] >= 0
    assert any(r.phases_s["wait"] > 0 for r in result.reports if r.stage == 1)  # stage 1 waits for inputs


def test_gpipe_matches_1f1b(cluster: Cluster):
    result = cluster.train(dataclasses.replace(CFG, job="gpipe", schedule="gpipe"))
    assert result.ok, result.errors
    one = cluster.curves.get("1f1b") or reference(CFG)
    assert rel(result.losses(), one) < 1e-4


def test_acsgd_fw4_bw8_with_8bit_gradients_stays_within_3_percent(cluster: Cluster):
    # 63 examples, 4 per replica and step: 7 steps per epoch, so 35 steps revisit every example 5 times
    small = dataclasses.replace(CFG, data=DataConfig(seq_len=32, max_bytes=2048), steps=35, lr=3e-3)
    compressed = dataclasses.replace(
        small,
        job="acsgd",
        compression=CompressionConfig(
            forward="acsgd",
            forward_bits=4,
            backward="quant",
            backward_bits=8,
            gradients="quant",
            gradient_bits=8,
        ),
    )
    result = cluster.train(compressed)
    assert result.ok, result.errors
    losses, plain = result.losses(), reference(small)
    assert len(losses) == 35 and plain[-1] < plain[0] - 1.0
    final, base = sum(losses[-3:]) / 3, sum(plain[-3:]) / 3
    assert abs(final - base) / base < 0.03, (final, base)
    # it really compressed: deltas at 4 bits after the first epoch, gradients at 8 bits
    fwd = sum(r.wire_bytes.get("b0.fwd.sent", 0) for r in result.reports if r.step >= 7)
    bwd = sum(r.wire_bytes.get("b0.bwd.sent", 0) for r in result.reports if r.step >= 7)
    raw = 28 * 2 * 4 * 32 * 64 * 4  # 28 steps x 2 replicas x (4 x 32 x 64) fp32 values
    assert fwd < 0.2 * raw and bwd < 0.35 * raw, (fwd / raw, bwd / raw)


def test_killed_run_resumes_from_checkpoints_on_the_same_curve(cluster: Cluster, tmp_path: Path):
    cfg = dataclasses.replace(CFG, job="resume", steps=12, checkpoint_dir=str(tmp_path), checkpoint_every=4)

    cluster.kill_after(cfg, 6)  # every peer stops abruptly in step 7: no clean-shutdown checkpoint
    result = cluster.train(cfg, resume=True)
    assert result.ok, result.errors
    assert result.start_step == 4  # the newest checkpoint every tasklet has
    assert rel(result.losses(), reference(cfg)[4:]) < 1e-4


def _buffers(state: dict) -> dict[int, torch.Tensor]:
    """Example id -> buffered row of one side's AC-SGD state (as saved in a stage checkpoint)."""
    out = {}
    for chunk in state["buffers"]["chunks"]:
        for j, ex in enumerate(chunk["ids"].tolist()):
            out[ex] = chunk["rows"][j]
    return out


def _assert_mirrored(sent: dict, received: dict) -> int:
    a, b = _buffers(sent), _buffers(received)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[i], b[i]) for i in a)  # bit for bit
    return len(a)


def test_killed_acsgd_run_resumes_with_its_buffers_on_the_uninterrupted_curve(
    cluster: Cluster, tmp_path: Path
):
    # 63 examples, 8 per step: epoch 2 starts at step 7, so the resume at step 8 revisits examples
    cfg = dataclasses.replace(
        CFG,
        job="acsgd-resume",
        data=DataConfig(seq_len=32, max_bytes=2048),
        steps=12,
        compression=CompressionConfig(forward="acsgd", forward_bits=4, backward="quant", backward_bits=8),
    )
    whole = cluster.train(cfg)
    assert whole.ok, whole.errors
    killed_cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), checkpoint_every=4)

    cluster.kill_after(killed_cfg, 9)  # every peer stops abruptly in step 10
    restored: dict[int, dict[str, dict]] = {}  # replica -> side -> AC-SGD state

    def snapshot(workers) -> None:  # the live buffers right after the restore, before training
        for w in workers:
            side = w.codecs.send_act if w.stage == 0 else w.codecs.recv_act
            state = copy.deepcopy(side.codec.state_dict())  # full chunks are views of live rows
            restored.setdefault(w.replica, {})["send" if w.stage == 0 else "recv"] = state

    result = cluster.train(killed_cfg, resume=True, prepare=snapshot)
    assert result.ok, result.errors
    assert result.start_step == 8
    # the same numbers as the run that was never stopped (not merely close: the same arithmetic)
    assert rel(result.losses(), whole.losses()[8:]) < 1e-6
    # buffers came back: step 8 revisits examples and sends them as 4-bit deltas, not seeds
    for r in (r for r in result.reports if r.step == 8 and r.stage == 0):
        raw = 4 * 32 * 64 * 4
        assert r.wire_bytes["b0.fwd.sent"] < 0.2 * raw, r.wire_bytes
    same_step = next(r for r in whole.reports if r.step == 8 and r.stage == 0)
    resumed = next(
        r for r in result.reports if r.step == 8 and r.stage == 0 and r.replica == same_step.replica
    )
    assert resumed.wire_bytes["b0.fwd.sent"] == same_step.wire_bytes["b0.fwd.sent"]
    # sender and receiver of each boundary: bit-identical when restored and after the last step
    assert len(restored) == REPLICAS
    for sides in restored.values():
        assert _assert_mirrored(sides["send"], sides["recv"]) > 20
    for replica in range(REPLICAS):
        s0 = checkpoint.load(checkpoint.tasklet_dir(tmp_path, cfg.job, 0, replica), 12)
        s1 = checkpoint.load(checkpoint.tasklet_dir(tmp_path, cfg.job, 1, replica), 12)
        _assert_mirrored(s0["codecs"]["send_act"], s1["codecs"]["recv_act"])


def test_one_replicas_rollback_state_restarts_both_replicas_on_the_uninterrupted_curve(cluster: Cluster):
    """Run 4 steps, take replica 0's state of step 3 (the rollback copy) for each stage, load it
    into fresh workers of both replicas and finish: the single-process run's curve (elastic D_DP's
    path: any surviving replica's state serves every replica of its stage)."""
    cfg = dataclasses.replace(CFG, job="rollback", steps=8, rollback=True)
    placement = Placement.grid(STAGES, REPLICAS)
    first = build_workers(cfg, placement, cluster.peers, reducer_factory=group_allreduce)
    head = cluster.run(run_workers(first, until=4))
    assert head.ok, head.errors
    assert all(w.available_steps() == (3, 4) for w in first)
    states = {w.stage: w.state_at(3) for w in first if w.replica == 0}
    assert all(s["codecs"] is None and s["averaging"] is None for s in states.values())
    fresh = build_workers(cfg, placement, cluster.peers, reducer_factory=group_allreduce)
    for w in fresh:
        assert w.load_state(states[w.stage]) == 3
    tail = cluster.run(run_workers(fresh))
    assert tail.ok, tail.errors
    assert {r.step for r in tail.reports} == set(range(3, 8))
    expected = reference(cfg)
    assert rel(head.losses(), expected[:4]) < 1e-5
    assert rel(tail.losses(), expected[3:]) < 1e-5


class PerStageClip:
    """The mean over replicas, then each stage clipped by its OWN norm: what global clipping must not be."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def reduce(self, stage: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        mean = [torch.stack(per_param).mean(dim=0) for per_param in zip(*grads, strict=True)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean]))
        scale = min(1.0, self.max_norm / (float(norm) + 1e-6))
        return [g * scale for g in mean]


def test_schedule_warmup_and_cross_stage_clipping_match_the_single_process_optimizer(cluster: Cluster):
    """AdamW with warm-up, cosine decay and a clip that is active every step: the 2 x 2 run follows the
    reference (torch's scheduler, one clip over the whole model) within 1e-4 per step, and
    is clearly off both the unclipped curve and the curve of each stage clipping by its own norm."""
    opt = OptimizerConfig(lr=3e-3, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1, grad_clip=0.25)
    cfg = dataclasses.replace(CFG, job="optim", steps=10, optimizer=opt)
    result = cluster.train(cfg)
    assert result.ok, result.errors
    losses, expected = result.losses(), reference(cfg)
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) < 1e-4
    # the clip matters, and it is the global norm's: per-stage clipping gives another curve
    unclipped = reference(dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, grad_clip=None)))
    local = LocalRunConfig(
        steps=10,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        layers_per_stage=cfg.layers_per_stage,
        replicas=REPLICAS,
        optimizer=dataclasses.replace(opt, grad_clip=None),
    )
    per_stage = train_pipelined(
        GPT(cfg.model.gpt(), seed=0), build_dataset(cfg.data), local, reducer=PerStageClip(0.25)
    )
    for other in (unclipped, per_stage):
        assert max(abs(a - b) for a, b in zip(losses, other, strict=True)) > 1e-2
    assert all(not stats["rejected"] for stats in result.stats.values())
