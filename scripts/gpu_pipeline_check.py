"""The GPU check's pipeline part: 2 stages x 1 replica as two peer processes sharing one device.

Runs the same job four ways and prints one JSON object:
  * fp32 on ``--device`` (both stage processes on the one GPU, real p2p streams on loopback),
  * fp32 on the CPU (the same processes' arithmetic on the host: the step-time baseline),
  * bf16 autocast on ``--device``,
  * the single-process fp32 reference (``peerd.pipeline.local``) on the CPU,
and reports the device run's largest relative loss difference to the reference (the exactness
bar is 1e-4), per-stage median step times on the device and on the CPU and their ratio (a
pipeline step as each stage sees it: its neighbour's work and the streams included), each
stage's own compute time (forward + backward of one micro-batch, nothing else) on the device
and on the CPU, and whether bf16 trained (its last loss below its first). ``--device cpu`` runs everything on the
CPU (what the tests do here); a CUDA device that is not present is an error (exit 2).

Usage: python scripts/gpu_pipeline_check.py [--device cuda] [--steps 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from peerd.data.config import DataConfig, build_dataset
from peerd.models.gpt import GPT
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.launch import Placement, RunResult
from peerd.pipeline.local import LocalRunConfig, train_pipelined
from peerd.pipeline.partition import balanced_layers_per_stage
from peerd.pipeline.processes import PeerProcesses


def job_config(args: argparse.Namespace) -> TrainConfig:
    overrides = {
        "n_layer": args.layers,
        "d_model": args.d_model,
        "n_head": max(1, args.d_model // 64),
        "max_seq_len": args.seq_len,
    }
    model = ModelBuild("tiny", overrides)
    return TrainConfig(
        job="gpu-check",
        model=model,
        data=DataConfig(seq_len=args.seq_len, max_bytes=256 * 1024),
        layers_per_stage=balanced_layers_per_stage(args.layers + 2, 2),
        global_batch=args.batch,
        micro_batch_size=args.micro_batch,
        steps=args.steps,
        lr=3e-3,
        device=args.device,
    )


def stage_times(result: RunResult) -> dict[str, float]:
    """Median step seconds per stage (step 0 left out: it warms up kernels and allocators)."""
    out: dict[str, list[float]] = {}
    for r in result.reports:
        if r.step > 0:
            out.setdefault(f"stage{r.stage}", []).append(r.step_s)
    return {k: round(statistics.median(v), 5) for k, v in sorted(out.items())}


async def run_all(cfg: TrainConfig, threads: int) -> dict[str, RunResult]:
    procs = PeerProcesses(2, [sys.executable, "-m", "peerd.bench.pipeline"], threads=threads)
    runs: dict[str, RunResult] = {}
    try:
        await procs.start()
        placement = Placement([[0], [1]])
        runs["device_fp32"] = await procs.run(cfg, placement, timeout=600)
        runs["cpu_fp32"] = await procs.run(
            dataclasses.replace(cfg, job="gpu-check-cpu", device="cpu"), placement, timeout=600
        )
        runs["device_bf16"] = await procs.run(
            dataclasses.replace(cfg, job="gpu-check-bf16", precision="bf16"), placement, timeout=600
        )
    finally:
        await procs.close()
    return runs


def stage_compute_s(cfg: TrainConfig, device: torch.device, repeat: int = 10) -> dict[str, float]:
    """Median seconds of forward + backward of one micro-batch through each stage on ``device``."""
    from peerd.pipeline.partition import partition

    model = GPT(cfg.model.gpt(), seed=cfg.model.seed)
    stages = [s.to(device) for s in partition(model, cfg.layers_per_stage)]
    b, t, c = cfg.micro_batch_size, cfg.data.seq_len, cfg.model.gpt().d_model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (b, t), generator=gen).to(device)
    hidden = torch.randn(b, t, c, generator=gen).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = {}
    for i, stage in enumerate(stages):
        times = []
        for _ in range(repeat + 2):
            x = tokens if i == 0 else hidden.clone().requires_grad_(True)
            sync()
            start = time.perf_counter()
            y = stage(x)
            y.float().square().mean().backward()
            sync()
            times.append(time.perf_counter() - start)
        out[f"stage{i}"] = round(statistics.median(times[2:]), 6)  # two warm-up rounds
    return out


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu [default: cuda]")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (split over 2 stages)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4, help="torch threads per peer process")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": f"--device {args.device}: CUDA is not available here"}))
        return 2
    cfg = job_config(args)
    cfg.validate()
    runs = asyncio.run(run_all(cfg, args.threads))
    errors = {name: [dataclasses.asdict(e) for e in r.errors] for name, r in runs.items() if r.errors}
    local = LocalRunConfig(
        steps=cfg.steps,
        global_batch=cfg.global_batch,
        micro_batch_size=cfg.micro_batch_size,
        layers_per_stage=cfg.layers_per_stage,
        optimizer=cfg.optimizer,
    )
    reference = train_pipelined(GPT(cfg.model.gpt(), seed=cfg.model.seed), build_dataset(cfg.data), local)
    out: dict[str, Any] = {
        "config": {
            "device": args.device,
            "device_name": torch.cuda.get_device_name(torch.device(args.device))
            if args.device.startswith("cuda")
            else "cpu",
            "model": dataclasses.asdict(cfg.model.gpt()),
            "layers_per_stage": cfg.layers_per_stage,
            "global_batch": cfg.global_batch,
            "micro_batch_size": cfg.micro_batch_size,
            "seq_len": cfg.data.seq_len,
            "steps": cfg.steps,
            "threads_per_peer": args.threads,
        },
        "errors": errors,
        "reference_losses": [round(x, 6) for x in reference],
    }
    if not errors:
        dev, cpu, bf16 = (runs[k] for k in ("device_fp32", "cpu_fp32", "device_bf16"))
        t_dev, t_cpu = stage_times(dev), stage_times(cpu)
        out.update(
            {
                "device_losses": [round(x, 6) for x in dev.losses()],
                "device_vs_reference_max_rel": rel(dev.losses(), reference),
                "cpu_vs_reference_max_rel": rel(cpu.losses(), reference),
                "bf16_losses": [round(x, 6) for x in bf16.losses()],
                "bf16_vs_reference_max_rel": rel(bf16.losses(), reference),
                "bf16_trains": bf16.losses()[-1] < bf16.losses()[0],
                "stage_step_s_device": t_dev,
                "stage_step_s_cpu": t_cpu,
                "stage_speedup_device_vs_cpu": {k: round(t_cpu[k] / t_dev[k], 2) for k in t_dev},
                "stage_step_s_device_bf16": stage_times(bf16),
            }
        )
        c_dev, c_cpu = (
            stage_compute_s(cfg, torch.device(args.device)),
            stage_compute_s(cfg, torch.device("cpu")),
        )
        out["stage_compute_s_device"], out["stage_compute_s_cpu"] = c_dev, c_cpu
        out["stage_compute_speedup_device_vs_cpu"] = {k: round(c_cpu[k] / c_dev[k], 2) for k in c_dev}
        out["ok"] = out["device_vs_reference_max_rel"] < 1e-4 and out["bf16_trains"]
    else:
        out["ok"] = False
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
