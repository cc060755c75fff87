"""StageWorker without a network: a one-stage job reproduces the reference run; checkpoints resume it exactly."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from peerd.data.config import DataConfig, build_dataset
from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.models.gpt import GPT
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.frames import KIND_ACT, KIND_GRAD
from peerd.pipeline.frames import check_message as check
from peerd.pipeline.local import LocalRunConfig, train_pipelined, train_unstaged
from peerd.pipeline.worker import StageWorker

CFG = TrainConfig(
    job="unit",
    model=ModelBuild("tiny", {"n_layer": 2, "d_model": 32, "max_seq_len": 32}),
    data=DataConfig(seq_len=16, max_bytes=32 * 1024),
    layers_per_stage=[4],
    global_batch=8,
    micro_batch_size=3,  # uneven micro-batches: 3 + 3 + 2
    steps=12,
    lr=3e-3,
    device="cpu",  # the exactness bar is against the CPU reference (a GPU run has its own check)
)


def one_stage(cfg: TrainConfig = CFG) -> StageWorker:
    return StageWorker(
        cfg,
        stage=0,
        replica=0,
        replicas=1,
        transport=None,
        upstream=None,
        downstream=None,  # type: ignore[arg-type]
    )


def run(worker: StageWorker, until: int | None = None) -> list[float]:
    async def go():
        try:
            return await worker.run(until)
        finally:
            await worker.close()

    return [r.loss for r in asyncio.run(go())]  # type: ignore[misc]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_one_stage_worker_reproduces_the_reference_runs():
    worker = one_stage()
    losses = run(worker)
    assert worker.unreported_loss() is None  # every applied step was reported
    dataset = build_dataset(CFG.data)
    local = LocalRunConfig(steps=12, global_batch=8, micro_batch_size=3, layers_per_stage=[4], lr=3e-3)
    pipelined = train_pipelined(GPT(CFG.model.gpt(), seed=0), dataset, local)
    assert losses == pipelined  # same arithmetic, same order: bit-identical
    unstaged = train_unstaged(
        GPT(CFG.model.gpt(), seed=0), dataset, dataclasses.replace(local, micro_batch_size=8)
    )
    assert _rel(losses, unstaged) < 1e-4
    assert losses[-1] < losses[0] - 0.3  # it trains


def test_checkpoint_resume_continues_the_same_curve(tmp_path: Path):
    cfg = dataclasses.replace(CFG, checkpoint_dir=str(tmp_path), checkpoint_every=4, keep_checkpoints=2)
    full = run(one_stage(dataclasses.replace(cfg, checkpoint_dir=None)))
    first = run(one_stage(cfg), until=10)  # saves 4, 8 and (clean stop) 10; keeps the newest two
    assert first == full[:10]
    steps = sorted(p.name for p in (tmp_path / "unit" / "stage0-replica0").iterdir())
    assert steps == ["step-00000008.pt", "step-00000010.pt"]
    resumed = one_stage(cfg)
    assert resumed.restore(8) == 8
    assert run(resumed) == full[8:]


def test_restore_refuses_a_checkpoint_of_another_run(tmp_path: Path):
    cfg = dataclasses.replace(CFG, checkpoint_dir=str(tmp_path))
    run(one_stage(cfg), until=2)
    with pytest.raises(ConfigError, match="global_batch"):
        one_stage(dataclasses.replace(cfg, global_batch=6)).restore()
    with pytest.raises(ConfigError, match="step 5"):
        one_stage(cfg).restore(5)


def test_allocation_mistakes_are_config_errors():
    two = dataclasses.replace(CFG, layers_per_stage=[2, 2])
    with pytest.raises(ConfigError, match="neighbours"):
        StageWorker(two, stage=0, replica=0, replicas=1, transport=None, upstream=None, downstream=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reducer"):
        StageWorker(CFG, stage=0, replica=0, replicas=2, transport=None, upstream=None, downstream=None)  # type: ignore[arg-type]
    tied = dataclasses.replace(two, model=ModelBuild("tiny", {"tie_weights": True}))
    with pytest.raises(ConfigError, match="tied"):
        tied.validate()


def test_a_middle_stage_expects_its_neighbours_frames():
    three = dataclasses.replace(
        CFG,
        model=ModelBuild("tiny", {"n_layer": 4, "d_model": 32, "max_seq_len": 32}),
        layers_per_stage=[2, 2, 2],
        compression=CompressionConfig(forward="acsgd", forward_bits=2, backward="quant", backward_bits=8),
    )
    w = StageWorker(three, stage=1, replica=0, replicas=1, transport=None, upstream="up", downstream="down")  # type: ignore[arg-type]
    act, grad = w.receiver.expectations[KIND_ACT](5), w.receiver.expectations[KIND_GRAD](5)
    assert (act.boundary, act.codec, act.steps) == (0, "acsgd-q2", (5, 6))
    assert (grad.boundary, grad.codec, grad.row_shape) == (1, "q8", (16, 32))
    ids = w._ids_of(6, 2)
    assert ids is not None and len(ids) == 2 and w._ids_of(6, 3) is None
    msg = w._message(KIND_GRAD, 6, 2, ids, torch.zeros(2, 16, 32), b"x" * 10)
    assert msg.boundary == 0 and msg.codec == "q8"
    with pytest.raises(ProtocolError) as info:
        check(msg, act)  # our own gradient is not what we accept from upstream
    assert info.value.code == ErrorCode.NOT_ALLOWED
    asyncio.run(w.close())


def test_placement_grid_validation_and_the_links_to_shape():
    from peerd.pipeline.launch import Placement, RunResult

    two_by_two = dataclasses.replace(CFG, layers_per_stage=[2, 2])
    grid = Placement.grid(2, 2)
    assert grid.peers == [[0, 1], [2, 3]] and list(grid.tasklets())[1] == (0, 1, 1)
    grid.validate(two_by_two, 4)
    assert grid.tasklet_of(2) == (1, 0)
    with pytest.raises(ConfigError, match="no tasklet"):
        grid.tasklet_of(4)
    assert grid.neighbour_pairs() == {frozenset((0, 2)), frozenset((1, 3))}
    for bad, peers in ((Placement([[0, 1], [2]]), 4), (Placement([[0, 1], [1, 3]]), 4), (grid, 3)):
        with pytest.raises(ConfigError):
            bad.validate(two_by_two, peers)
    with pytest.raises(ConfigError, match="stages"):
        Placement.grid(3, 1).validate(two_by_two, 3)
    with pytest.raises(ConfigError, match="global_batch"):
        Placement.grid(2, 3).validate(two_by_two, 6)  # 8 examples do not split over 3 replicas

    def report(step: int, replica: int, loss: float | None):
        from peerd.pipeline.worker import StepReport

        return StepReport("j", 1 if loss is not None else 0, replica, step, loss, 4, 64, 0.1, 1.0)

    result = RunResult(0, [report(0, 0, 2.0), report(0, 1, 4.0), report(0, 0, None), report(1, 0, 1.0)])
    assert result.losses() == [3.0]  # step 1 is incomplete (one replica): not a global loss yet


# ---------------------------------------------------------------- state API (churn recovery)


def reference_states(cfg: TrainConfig, steps: int) -> list[dict[str, torch.Tensor]]:
    """The single-process model's stage-0 weights at the start of every step 0..steps."""
    from peerd.pipeline.local import optimizer_and_scheduler
    from peerd.pipeline.partition import partition

    model, dataset = GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data)
    stage = partition(model, cfg.layers_per_stage)[0]
    local = LocalRunConfig(
        steps=1,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        optimizer=cfg.optimizer,
        total_steps=cfg.steps,
    )
    opt, sched = optimizer_and_scheduler(list(model.parameters()), local, None, None)
    out = [{k: v.clone() for k, v in stage.state_dict().items()}]
    for step in range(steps):
        once = dataclasses.replace(local, start_step=step)
        train_pipelined(model, dataset, once, optimizer=opt, scheduler=sched)
        out.append({k: v.clone() for k, v in stage.state_dict().items()})
    return out


def same_weights(module: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool:
    assert module.keys() == ref.keys()
    return all(torch.equal(module[k], ref[k]) for k in ref)


def test_rollback_keeps_the_step_before_and_its_state_continues_the_same_curve():
    cfg = dataclasses.replace(CFG, rollback=True, steps=8)
    full = run(one_stage(dataclasses.replace(cfg, rollback=False)))
    worker = one_stage(cfg)
    assert worker.available_steps() == (0,)
    assert run(worker, until=5) == full[:5]
    assert worker.available_steps() == (4, 5)
    refs = reference_states(cfg, 5)
    before, now = worker.state_at(4), worker.state_at(5)
    assert (before["step"], now["step"]) == (4, 5)
    assert same_weights(before["module"], refs[4]) and same_weights(now["module"], refs[5])
    assert (before["data"]["epoch"], before["data"]["batch"]) == worker.sampler.position(4)
    assert before["codecs"] is None and before["averaging"] is None
    assert now["codecs"] == {}  # uncompressed: no AC-SGD buffers, but the live entry is there
    with pytest.raises(ConfigError, match="step"):
        worker.state_at(3)
    for state, start in ((before, 4), (now, 5)):
        fresh = one_stage(cfg)
        assert fresh.load_state(state) == start
        assert fresh.available_steps() == (start,)  # no snapshot survives a load
        assert run(fresh) == full[start:]
    # without rollback only the current step is kept
    plain = one_stage(dataclasses.replace(cfg, rollback=False))
    run(plain, until=3)
    assert plain.available_steps() == (3,)
    with pytest.raises(ConfigError, match="step"):
        plain.state_at(2)


def test_load_state_takes_another_replicas_state_and_refuses_other_runs():
    worker = one_stage()
    run(worker, until=2)
    state = worker.state_at(2)
    other = {**state, "replica": 1, "data": {**state["data"], "replicas": 2}}  # elastic D_DP
    assert one_stage().load_state(other) == 2
    changes = {
        "state.job": {"job": "other"},
        "state.stage": {"stage": 1},
        "state.meta.layers": {"meta": {**state["meta"], "layers": [0, 3]}},
        "state.data.digest": {"data": {**state["data"], "digest": "x"}},
        "state.data.seed": {"data": {**state["data"], "seed": 7}},
        "state.data.global_batch": {"data": {**state["data"], "global_batch": 6}},
        "state.format": {"format": 99},
    }
    for field_name, change in changes.items():
        with pytest.raises(ConfigError) as info:
            one_stage().load_state({**state, **change})
        assert info.value.field == field_name
    with pytest.raises(ConfigError, match=r"state\.optimizer"):
        one_stage().load_state({k: v for k, v in state.items() if k != "optimizer"})


def test_a_cancel_during_the_update_never_splits_it():
    """Cancel ``run`` while the compute thread is inside step 3's optimizer step: after ``quiesce``
    the worker says step 4 and holds step 4's weights (the update finished, and was counted)."""
    import threading

    worker = one_stage(dataclasses.replace(CFG, rollback=True))
    worker.inline_compute_s = 0.0  # every call in the compute thread, as a large model's
    refs = reference_states(CFG, 4)
    released, inside = threading.Event(), threading.Event()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(worker.run())

        def pre_step(_opt, _args, _kwargs) -> None:  # compute thread, just before AdamW's update
            if worker.step == 3:
                inside.set()
                loop.call_soon_threadsafe(task.cancel)
                released.wait(30)  # the update is held until the cancel has reached the task

        worker.optimizer.register_step_pre_hook(pre_step)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert inside.is_set() and worker.step == 3  # cancelled mid-update: not counted yet
        released.set()
        await worker.quiesce()
        await worker.close()

    asyncio.run(go())
    assert worker.step == 4 and worker.available_steps() == (3, 4)
    assert same_weights(worker.state_at(4)["module"], refs[4])
    assert same_weights(worker.state_at(3)["module"], refs[3])
    # step 3 was applied but never reported: its loss is still there for the curve
    assert [r.step for r in worker.reports] == [0, 1, 2]
    assert worker.unreported_loss() == (3, run(one_stage(dataclasses.replace(CFG, steps=4)))[3])


def test_reset_codecs_empties_both_acsgd_sides():
    three = dataclasses.replace(
        CFG,
        model=ModelBuild("tiny", {"n_layer": 4, "d_model": 32, "max_seq_len": 32}),
        layers_per_stage=[2, 2, 2],
        compression=CompressionConfig(forward="acsgd", forward_bits=2, backward="quant", backward_bits=8),
    )
    w = StageWorker(three, stage=1, replica=0, replicas=1, transport=None, upstream="up", downstream="down")  # type: ignore[arg-type]
    assert w.codecs.send_act is not None and w.codecs.recv_act is not None
    x = torch.randn(2, 16, 32)
    payload = w.codecs.send_act.encode((1, 2), x)  # this stage's buffers toward stage 2 ...
    msg = w._message(KIND_ACT, 0, 0, [1, 2], x, payload)
    w.codecs.recv_act.decode(msg, bytearray(payload))  # ... and (the same rows) from stage 0
    assert {side: b["examples"] for side, b in w.codecs.buffers().items()} == {"send_act": 2, "recv_act": 2}
    w.reset_codecs()
    assert {side: b["examples"] for side, b in w.codecs.buffers().items()} == {"send_act": 0, "recv_act": 0}
    asyncio.run(w.close())


def test_short_compute_calls_run_on_the_loop_and_never_beside_the_compute_thread():
    """A CPU stage's call whose last run was short runs on the event loop (a thread hand-off would
    cost more); a call with no history, a long one, or any call while the thread is busy goes there."""
    import threading
    import time

    worker = one_stage()

    def where() -> threading.Thread:
        return threading.current_thread()

    def slow_where() -> threading.Thread:
        time.sleep(2 * worker.inline_compute_s)
        return threading.current_thread()

    async def go() -> None:
        loop_thread = threading.current_thread()
        assert await worker._compute(where) is not loop_thread  # not measured yet
        assert await worker._compute(where) is loop_thread
        await worker._compute(slow_where)
        assert await worker._compute(slow_where) is not loop_thread
        gate = threading.Event()
        busy = asyncio.ensure_future(worker._compute(gate.wait, 30.0))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(worker._compute(where))
        await asyncio.sleep(0.05)
        assert not queued.done()  # it waits for the busy thread instead of running beside it
        gate.set()
        await busy
        assert await queued is not loop_thread
        worker.inline_compute_s = 0.0
        assert await worker._compute(where) is not loop_thread
        await worker.close()

    asyncio.run(go())
