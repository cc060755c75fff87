"""Devices, precision and out-of-memory in a stage worker (CPU here; the CUDA cases run where a GPU is).

A stage's parameters, optimizer state, codecs and AC-SGD buffers live on ``TrainConfig.device``;
states handed out are host tensors and load back onto the worker's device; bf16/fp16 autocast
follows the single-process reference run with the same precision; an out-of-memory in a step
ends it with ``StageOutOfMemory`` carrying the numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from peerd.data.config import DataConfig, build_dataset
from peerd.errors import ConfigError, ErrorCode
from peerd.models.gpt import GPT
from peerd.pipeline.codec import CompressionConfig, build_codecs
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.frames import KIND_ACT
from peerd.pipeline.local import LocalRunConfig, train_pipelined
from peerd.pipeline.precision import LossScale, StagePrecision, check_precision
from peerd.pipeline.worker import StageOutOfMemory, StageWorker

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

CFG = TrainConfig(
    job="dev",
    model=ModelBuild("tiny", {"n_layer": 2, "d_model": 32, "max_seq_len": 32}),
    data=DataConfig(seq_len=16, max_bytes=32 * 1024),
    layers_per_stage=[4],
    global_batch=8,
    micro_batch_size=4,
    steps=10,
    lr=3e-3,
    device="cpu",
)


def one_stage(cfg: TrainConfig = CFG) -> StageWorker:
    return StageWorker(cfg, stage=0, replica=0, replicas=1, transport=None, upstream=None, downstream=None)  # type: ignore[arg-type]


def run(worker: StageWorker, until: int | None = None, *, close: bool = True) -> list[float]:
    async def go():
        try:
            return await worker.run(until)
        finally:
            if close:
                await worker.close()

    return [r.loss for r in asyncio.run(go())]  # type: ignore[misc]


def reference(cfg: TrainConfig, precision: str = "fp32") -> list[float]:
    local = LocalRunConfig(
        steps=cfg.steps,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        layers_per_stage=cfg.layers_per_stage,
        optimizer=cfg.optimizer,
        precision=precision,
    )
    return train_pipelined(GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data), local)


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors(v)]
    return []


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_and_optimizer_state_live_on_the_device_and_states_are_host_tensors(device):
    cfg = dataclasses.replace(CFG, device=device, steps=6)
    worker = one_stage(cfg)
    assert worker.device.type == device
    run(worker, until=3, close=False)
    assert {p.device.type for p in worker.module.parameters()} == {device}
    moments = [t for s in worker.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and {t.device.type for t in moments} == {device}  # AdamW's exp_avg / exp_avg_sq
    state = worker.state_dict()
    assert {t.device.type for t in tensors(state)} == {"cpu"}  # checkpoints and peers get host tensors
    asyncio.run(worker.close())
    fresh = one_stage(cfg)
    assert fresh.load_state(state) == 3  # loads back onto its device
    assert {p.device.type for p in fresh.module.parameters()} == {device}
    resumed = run(fresh)
    full = run(one_stage(cfg))
    assert rel(resumed, full[3:]) < 1e-6
    if device != "cpu":  # the same arithmetic up to kernels' summation order
        assert rel(full, run(one_stage(dataclasses.replace(cfg, device="cpu")))) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_boundary_codecs_and_acsgd_buffers_live_on_the_device(device, tmp_path: Path):
    comp = CompressionConfig(forward="acsgd", forward_bits=4, backward="quant", backward_bits=8)
    dev = torch.device(device)
    sender = build_codecs(comp, first=True, last=False, device=dev)
    receiver = build_codecs(comp, first=False, last=True, device=dev)
    assert sender.send_act is not None and receiver.recv_act is not None and receiver.send_grad is not None
    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(4, 16, 32, generator=gen).to(dev)
    for visit in range(3):  # a seed visit, then deltas
        payload = sender.send_act.encode((1, 2, 3, 4), acts + 0.01 * visit)
        assert isinstance(payload, bytes)
        msg = _act_message(payload)
        out = receiver.recv_act.decode(msg, bytearray(payload))
        assert out.device.type == device and out.dtype == torch.float32
        assert float((out - acts - 0.01 * visit).norm() / acts.norm()) < 0.1
    for side in (sender.send_act, receiver.recv_act):
        store = side.codec.store  # type: ignore[attr-defined]
        assert {c.rows.device.type for c in store._chunks} == {device}
        stats = side.buffers()  # type: ignore[attr-defined]
        if device == "cpu":
            assert stats["device_bytes"] == 0 and stats["ram_bytes"] > 0
        else:
            assert stats["device_bytes"] > 0 and stats["ram_bytes"] == 0
        assert {t.device.type for t in tensors(side.codec.state_dict())} == {"cpu"}  # type: ignore[attr-defined]
    # both ends hold the same reconstructions, whatever tier they sit in
    a, b = sender.send_act.codec.store, receiver.recv_act.codec.store  # type: ignore[attr-defined]
    assert all(torch.equal(a.get(i).cpu(), b.get(i).cpu()) for i in (1, 2, 3, 4))
    grad = receiver.send_grad.encode((1, 2, 3, 4), torch.randn(4, 16, 32, generator=gen).to(dev))
    assert isinstance(grad, bytes)
    assert sender.recv_grad is not None
    assert sender.recv_grad.decode(_act_message(grad), bytearray(grad)).device.type == device
    sender.close()
    receiver.close()


def _act_message(payload: bytes):
    from peerd.pipeline.frames import TensorMessage

    return TensorMessage(
        kind=KIND_ACT, job="dev", step=0, mb=0, boundary=0, ids=(1, 2, 3, 4), codec="acsgd-q4",
        shape=(4, 16, 32), dtype="float32", seq=0, nbytes=len(payload),
    )  # fmt: skip


@CUDA
def test_cuda_acsgd_buffers_fill_device_memory_then_pinned_ram_then_spill_files(tmp_path: Path):
    from peerd.compress import BufferConfig, BufferStore

    per_mb = 1 / 16  # one example: 16 x 1024 float32 = 64 KiB
    store = BufferStore(
        BufferConfig(
            device="cuda", device_budget_mb=2 * per_mb, ram_budget_mb=2 * per_mb, spill_dir=str(tmp_path),
            chunk_examples=2,
        )
    )  # fmt: skip
    store.check_shape((16, 1024))
    for ex in range(6):
        store.slot(ex).fill_(ex)
    kinds = [(c.rows.device.type, c.rows.is_pinned() if c.rows.device.type == "cpu" else None, c.path is not None)
             for c in store._chunks]  # fmt: skip
    assert kinds == [("cuda", None, False), ("cpu", True, False), ("cpu", False, True)]
    stats = store.stats()
    assert (stats.device_bytes, stats.ram_bytes, stats.spill_files) == (2 << 16, 2 << 16, 1)
    store.close()


def test_device_and_precision_are_checked_when_built():
    for field_name, change in (("device", {"device": "tpu"}), ("precision", {"precision": "fp8"})):
        with pytest.raises(ConfigError) as info:
            dataclasses.replace(CFG, **change).validate()
        assert info.value.field == field_name
    dataclasses.replace(CFG, layers_per_stage=[2, 2], precision="fp16").validate()  # stages share the verdict
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available") as info:
            one_stage(dataclasses.replace(CFG, device="cuda:0"))
        assert info.value.field == "device"
    with pytest.raises(ConfigError) as info:
        check_precision("fp8", torch.device("cpu"))
    assert info.value.field == "precision"


def test_auto_picks_an_accelerator_when_there_is_one():
    worker = one_stage(dataclasses.replace(CFG, device="auto"))
    want = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert worker.device.type == want
    asyncio.run(worker.close())


# ---------------------------------------------------------------- precision


def test_bf16_autocast_trains_and_follows_the_bf16_reference():
    cfg = dataclasses.replace(CFG, precision="bf16")
    losses = run(one_stage(cfg))
    assert losses[-1] < losses[0] - 0.3  # it trains
    # same autocast, same casts at the boundaries: within 1e-3 (measured: identical on CPU)
    assert rel(losses, reference(cfg, "bf16")) < 1e-3
    fp32 = reference(CFG)
    assert losses != fp32 and rel(losses, fp32) < 0.05  # the arithmetic changed, not the model


def test_fp16_loss_scale_trains_and_is_checkpointed(monkeypatch):
    monkeypatch.setattr(LossScale, "INITIAL", 2.0**24)  # the first steps overflow: they must be skipped
    cfg = dataclasses.replace(CFG, precision="fp16")
    worker = one_stage(cfg)
    assert worker.precision.loss_scale is not None
    losses = run(worker, close=False)
    assert losses[-1] < losses[0] - 0.3
    assert 1 <= worker.overflow_skips < cfg.steps
    assert rel(losses, reference(cfg, "fp16")) < 1e-3
    state = worker.state_dict()
    asyncio.run(worker.close())
    assert (
        state["scaler"]["scale"] == worker.precision.loss_scale.value == 2.0 ** (24 - worker.overflow_skips)
    )
    fresh = one_stage(cfg)
    fresh.load_state(state)
    assert (
        fresh.precision.loss_scale is not None
        and fresh.precision.loss_scale.value == state["scaler"]["scale"]
    )
    asyncio.run(fresh.close())


def test_the_loss_scale_follows_torchs_grad_scaler_step_for_step(monkeypatch):
    """Same scale, same skipped steps, same parameters as torch.amp.GradScaler, overflows included."""
    monkeypatch.setattr(LossScale, "INTERVAL", 3)  # so that growth happens within the run too
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Linear(4, 4) for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    opt_ours, opt_theirs = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs))
    precision = StagePrecision("fp16")
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    x = torch.randn(2, 4)
    for step in range(12):
        overflow = step in (1, 2, 7)
        for model, opt, scale in ((ours, opt_ours, precision.scale), (theirs, opt_theirs, scaler.scale)):
            opt.zero_grad()
            loss = model(x).square().mean() * (float("inf") if overflow else 1.0)
            scale(loss).backward()
        finite = precision.unscale(list(ours.parameters()))
        assert finite == (not overflow)
        assert precision.step(opt_ours, overflowed=not finite) == (not overflow)
        scaler.step(opt_theirs)
        scaler.update()
        assert precision.loss_scale is not None and precision.loss_scale.value == scaler.get_scale()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b)
    fresh = LossScale()
    fresh.load_state_dict(scaler.state_dict())  # a checkpoint torch's scaler wrote loads here
    assert (fresh.value, fresh.growth_tracker) == (
        precision.loss_scale.value,
        precision.loss_scale.growth_tracker,
    )


def test_fp32_runs_without_autocast():
    assert isinstance(StagePrecision("fp32").autocast(), type(__import__("contextlib").nullcontext()))


# ---------------------------------------------------------------- out of memory


@pytest.mark.parametrize(
    ("error", "requested"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ..."), "2.50 GiB"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried "
                "to allocate 1024 bytes. out of memory"
            ),
            "unknown",
        ),
        (MemoryError(), "unknown"),
    ],
)
def test_out_of_memory_in_a_step_fails_it_with_the_numbers(error, requested):
    worker = one_stage()

    def exhaust(_module, _inputs):
        if worker.step == 2:
            raise error

    worker.module.register_forward_pre_hook(exhaust)
    with pytest.raises(StageOutOfMemory) as info:
        run(worker)
    assert worker.step == 2  # the failed step was not applied
    message = str(info.value)
    assert info.value.code == ErrorCode.INFEASIBLE
    assert "out of memory on cpu in stage 0 step 2" in message
    assert f"requested {requested}" in message
    assert "free " in message and " GiB of " in message  # the host's free and total memory
    assert "unknown of" not in message


def test_other_runtime_errors_are_not_out_of_memory():
    worker = one_stage()

    def broken(_module, _inputs):
        raise RuntimeError("shape mismatch")

    worker.module.register_forward_pre_hook(broken)
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        run(worker)
    assert not isinstance(info.value, StageOutOfMemory)


# ---------------------------------------------------------------- the daemon's --device reaches the worker


def test_the_daemons_device_reaches_the_runner_and_the_worker(tmp_path: Path, caplog):
    """``peerd join --device cpu`` -> DaemonConfig -> JobService -> TaskletRunner -> TrainConfig -> StageWorker."""
    from peerd.config import load_config
    from peerd.jobs.records import new_job_record
    from peerd.jobs.runner import train_config
    from peerd.jobs.service import JobService
    from peerd.jobs.spec import parse_job_spec
    from peerd.sched.allocation import Allocation

    daemon = load_config(None, {"device": "cpu", "home": str(tmp_path)})  # what the CLI flags build
    service = JobService(
        dht=None, owner_tag=b"o" * 32, peer_id="me", clock=lambda: 0.0, swarm="s", transport=None,  # type: ignore[arg-type]
        home=tmp_path, region="", profile=lambda: None, links=list, peers=list, device=daemon.device,
    )  # fmt: skip
    spec = parse_job_spec(
        {
            "kind": "pretrain",
            "model": {"preset": "tiny"},
            "steps": 4,
            "global_batch": 4,
            "micro_batch": 2,
            "data": {"seq_len": 16, "max_bytes": 16384},
            "precision": "bf16",
        }
    )
    job = new_job_record("me", "s", spec, b"n" * 16, now=0.0, epoch0_start=0.0, timing=spec.planning.timing())
    runner = service.make_runner(job, spec)
    assert runner.device == "cpu"
    cfg = train_config(job.job_id, spec, Allocation(stages=(("me",),)), None, device=runner.device)
    assert (cfg.device, cfg.precision) == ("cpu", "bf16")
    with caplog.at_level("INFO", logger="peerd.pipeline.worker"):
        worker = one_stage(dataclasses.replace(cfg, job="j"))
    assert worker.device == torch.device("cpu") and worker.precision.name == "bf16"
    assert "job j stage 0 replica 0 computes on cpu in bf16" in caplog.text  # what the daemon's log says
    asyncio.run(worker.close())


def test_fp16_jobs_take_any_shape():
    from peerd.jobs.spec import parse_job_spec

    base = {"kind": "pretrain", "model": {"preset": "tiny"}, "steps": 4, "global_batch": 4, "micro_batch": 2,
            "precision": "fp16"}  # fmt: skip
    for parallel, peers in (({"d_pp": 2, "d_dp": 2}, 4), ({"d_pp": "auto", "d_dp": "auto"}, 1)):
        assert parse_job_spec({**base, "parallel": parallel, "min_peers": peers}).precision == "fp16"


def test_a_negative_norm_from_a_neighbour_is_only_the_fp16_overflow_verdict():
    from peerd.errors import PeerMisbehaved
    from peerd.pipeline.optim import OVERFLOWED, add_partial_norms

    assert add_partial_norms(2.0, 0.5) == 2.5
    assert add_partial_norms(OVERFLOWED, 0.5) == add_partial_norms(2.0, OVERFLOWED) == OVERFLOWED
    fp32, fp16 = one_stage(), one_stage(dataclasses.replace(CFG, precision="fp16"))
    try:
        assert fp16._received_norm(torch.tensor([OVERFLOWED], dtype=torch.float64), 3, "next") == OVERFLOWED
        for worker, value in ((fp32, OVERFLOWED), (fp16, -2.0), (fp32, -0.5)):
            with pytest.raises(PeerMisbehaved, match="step 3 from next") as info:
                worker._received_norm(torch.tensor([value], dtype=torch.float64), 3, "next")
            assert info.value.peer == "next" and info.value.code == ErrorCode.OUT_OF_RANGE
        assert fp32._received_norm(torch.tensor([0.25], dtype=torch.float64), 3, "next") == 0.25
    finally:
        for worker in (fp32, fp16):
            asyncio.run(worker.close())


def test_the_groups_wait_for_the_slowest_replica_is_its_own_phase():
    class Stats:
        waited_s = 0.0

    class Group:
        stats = Stats()
        any_overflowed = False

        def follow_deadline(self, seconds):
            pass

        async def allreduce(self, step, tensors, overflowed=False):
            await asyncio.sleep(0.05)
            self.stats.waited_s += 0.03  # as GroupAllReduce counts the wait for the others' parts
            return list(tensors)

    worker = StageWorker(
        CFG, stage=0, replica=0, replicas=2, transport=None,  # type: ignore[arg-type]
        upstream=None, downstream=None, reducer=Group(),  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        run(worker, until=3, close=False)
        for r in worker.reports:
            assert r.phases_s["averaging_wait"] == pytest.approx(0.03)
            assert r.phases_s["averaging"] >= 0.015  # the rest of the 50 ms call
            assert sum(r.phases_s.values()) == pytest.approx(r.step_s, rel=0.01, abs=1e-3)
    finally:
        asyncio.run(worker.close())


def test_the_averaging_group_waits_as_long_as_the_worker_deadline_allows():
    class Group:
        def follow_deadline(self, seconds):
            self.seconds = seconds

        any_overflowed = False

        async def allreduce(self, step, tensors, overflowed=False):
            return list(tensors)

    group = Group()
    cfg = dataclasses.replace(CFG, averaging_timeout_s=90.0)
    worker = StageWorker(
        cfg, stage=0, replica=0, replicas=2, transport=None,  # type: ignore[arg-type]
        upstream=None, downstream=None, reducer=group,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        assert group.seconds() == 90.0  # the configured limit until steps are seen
        run(worker, until=4, close=False)
        slowest = max(r.step_s for r in worker.reports)
        assert group.seconds() == worker.averaging_deadline.seconds() < 90.0
        assert group.seconds() >= min(cfg.streams.deadlines.floor_s, 90.0) >= slowest
    finally:
        asyncio.run(worker.close())
