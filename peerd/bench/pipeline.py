"""``peerd bench pipeline``: pipeline training throughput on shaped loopback links, uncompressed vs AC-SGD.

Part 1 (``training``): a 2-stage GPT job, one OS process per peer (each its own p2pd), links
between pipeline neighbours shaped to each ``--links`` setting (replica-group links unshaped,
as within a site), in two layouts (``--layouts``): 2 stages x 2 replicas, the issue's setting,
and 2 stages x 1 replica. Per layout, schedule and link it runs the job uncompressed and with
every ``--codecs`` setting on the same processes (same model, data, steps, seed and schedule:
only the codecs differ; every replica gets the same batch in both layouts), and reports
steady-state tokens/s (median step, and the fastest step: the machine is shared), the
speed-up over uncompressed, the final loss, and bytes on the wire per step per boundary by
direction, all after ``--warmup`` steps (one epoch, so AC-SGD sends deltas, not first-visit
seeds). Part 2 (``stream``, ``peerd.bench.transport.pipeline_stream``): activation messages
through the pipeline stream vs a raw hivemind binary stream of the same bytes (target >= 0.8).

Which regime, and why. The AC-SGD paper's speed-ups are claims about communication-bound
training (third-party GPT2-XL numbers: uncompressed at 100 Mbit/s ran ~4-6x below the
compressed run's compute-bound speed). A token crossing a boundary is ``4 * d_model`` bytes
each way, 0.32 us per channel at 100 Mbit/s; computing it costs ~72 d_model^2 FLOP per block
plus attention (~12 seq_len d_model) plus the vocab-256 head: compute grows with d_model^2
and seq_len, bytes only with d_model. Measured on these 2 cores (one thread, both stages,
forward + backward): d_model 64 costs 21 us per token at seq_len 256 and 15 us at 32,
d_model 128 41 us, against 20.5 us (d_model 64) of link time per direction at 100 Mbit/s.
The default job is therefore the most communication-heavy model that is still a transformer
worth the name: 2 blocks, d_model 64 and 32-token sequences (attention's seq_len term was
40 % of the FLOPs at 256 and carries no bytes), 8192 tokens per replica and step in 8
micro-batches (a small pipeline bubble), with GPipe, the paper's schedule (all forwards, then
all backwards). In the 2x2 layout the 4 peer processes share the 2 cores, so a replica's two
stages get about one core and 100 Mbit/s is only about as link-bound as compute-bound
(``regime.link_over_compute`` ~0.6-0.9: fp32 link time per direction over the unshaped step
time): measured ~1.8x there, ~4.5x at 20 Mbit/s, where these cores are in the paper's regime.
The 2x1 layout gives each stage a core of its own, as each stage has its own GPU in the paper:
100 Mbit/s is then clearly link-bound (ratio ~1.3-1.4 per direction, ~2.7 with GPipe's
directions in series), the setting the paper's 100 Mbit/s numbers describe: measured ~3x.
``--schedules 1f1b`` overlaps the two link directions, a faster uncompressed baseline on
delay-free links (speed-ups at 100 Mbit/s ~1.45x for 2x2, ~2.1x for 2x1), but keeps only 2
micro-batches in flight, so a 25 ms link makes it latency-bound, compressed or not.

Fixed bandwidths put the two layouts in different regimes, so their speed-ups do not compare.
``--match`` (default 4, the paper's ~4-6) adds, per layout, a link whose bandwidth makes the
fp32 link time per direction that multiple of the layout's own unshaped step, measured just
before on the same processes; ``speedup_at_matched_regimes`` lists the speed-ups there, the
figures to hold against the paper's.

Run as a module (``python -m peerd.bench.pipeline``) this file is the peer process.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import click

from peerd.averaging import GroupAllReduce
from peerd.bench import emit_json
from peerd.bench.transport import pipeline_stream
from peerd.data.config import DataConfig
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.launch import Placement, RunResult
from peerd.pipeline.processes import PeerProcesses, child_main
from peerd.pipeline.schedule import available_schedules
from peerd.pipeline.streams import (
    StreamConfig,
)
from peerd.swarm.shaper import LinkSpec
from peerd.swarm.transport import Transport

CODECS = {
    "none": CompressionConfig(),
    "acsgd-fw4-bw8": CompressionConfig(forward="acsgd", forward_bits=4, backward="quant", backward_bits=8),
    "acsgd-fw2-bw8": CompressionConfig(forward="acsgd", forward_bits=2, backward="quant", backward_bits=8),
    "acsgd-fw4-bw8-g8": CompressionConfig(
        forward="acsgd", forward_bits=4, backward="quant", backward_bits=8, gradients="quant", gradient_bits=8
    ),
}


def group_allreduce(transport: Transport, group: list, me: Any, key: str, cfg: TrainConfig) -> GroupAllReduce:
    """The reducer every peerd pipeline run uses: the stage's replica group all-reduce."""
    return GroupAllReduce(
        transport,
        group,
        me,
        key=key,
        compressor=cfg.compression.gradient_compressor,
        timeout=cfg.averaging_timeout_s,
        loss_scaled=cfg.precision == "fp16",
    )


def parse_links(text: str) -> list[tuple[str, LinkSpec]]:
    """``"1000,100,20+25"``: Mbit/s, optionally ``+`` one-way delay in ms."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        rate, _, delay = item.partition("+")
        try:
            spec = LinkSpec(delay_s=float(delay or 0) / 1e3, bandwidth_bps=float(rate) * 1e6)
        except ValueError:
            raise click.BadParameter(f"link {item!r}: expected MBIT[+DELAY_MS]") from None
        out.append((f"{rate}mbit" + (f"+{delay}ms" if delay else ""), spec))
    return out


def job_config(args: dict[str, Any], schedule: str = "gpipe", replicas: int = 2) -> TrainConfig:
    global_batch = args["replica_batch"] * replicas  # every layout gives a replica the same work
    per_epoch = args["warmup"]  # steps per epoch: the dataset holds exactly warmup global batches
    examples = per_epoch * global_batch
    return TrainConfig(
        job="bench",
        model=ModelBuild(
            "tiny",
            {
                "n_layer": args["n_layer"],
                "n_head": max(1, args["d_model"] // 32),
                "d_model": args["d_model"],
                "max_seq_len": args["seq_len"],
            },
        ),
        data=DataConfig(seq_len=args["seq_len"], max_bytes=examples * args["seq_len"] + 1),
        layers_per_stage=_halves(args["n_layer"] + 2),
        global_batch=global_batch,
        micro_batch_size=args["micro_batch"],
        steps=args["warmup"] + args["steps"],
        schedule=schedule,
        lr=1e-3,
        streams=StreamConfig(recv_timeout_s=300, ack_timeout_s=300, stall_timeout_s=120),
        averaging_timeout_s=300,
    )


def _halves(layers: int) -> list[int]:
    return [layers - layers // 2, layers // 2]


def step_walls(result: RunResult, warmup: int) -> list[float]:
    """Wall time of every measured step: between the ends of consecutive steps (slowest tasklet)."""
    ends: dict[int, float] = {}
    for r in result.reports:
        ends[r.step] = max(ends.get(r.step, 0.0), r.finished_at)
    return [ends[s] - ends[s - 1] for s in sorted(ends) if s >= warmup]


def summarize(results: list[RunResult], cfg: TrainConfig, warmup: int) -> dict[str, Any]:
    failed = [e.__dict__ for r in results for e in r.errors]
    if failed:
        return {"errors": failed}
    # pooled over the repeats; the median resists the shared machine's noise
    walls = [w for r in results for w in step_walls(r, warmup)]
    step_s = statistics.median(walls)
    first = results[0]
    measured = [s for s in range(warmup, cfg.steps)]
    first_epoch = list(range(warmup))

    def per_step(key: str, steps: list[int]) -> int:
        total = sum(r.wire_bytes.get(key, 0) for r in first.reports if r.step in steps)
        return round(total / max(1, len(steps)))

    losses = first.losses()
    tokens = cfg.global_batch * cfg.data.seq_len
    return {
        "tokens_per_s": round(tokens / step_s, 1),
        # the fastest step: what the machine can do when the other tenants of its cores are quiet
        "tokens_per_s_best": round(tokens / min(walls), 1),
        "step_s_median": round(step_s, 4),
        "step_s_min": round(min(walls), 4),
        "step_s_mean": round(sum(walls) / len(walls), 4),
        "steps_measured": len(walls),
        "final_loss": round(sum(losses[-3:]) / len(losses[-3:]), 4),
        "bytes_per_step": {  # boundary 0, both replicas, wire bytes (frames incl. headers)
            "b0.fwd": per_step("b0.fwd.sent", measured),
            "b0.bwd": per_step("b0.bwd.sent", measured),
            "b0.fwd.first_epoch": per_step("b0.fwd.sent", first_epoch),
        },
    }


async def training(
    args: dict[str, Any], links: list[tuple[str, LinkSpec]], codecs: list[str], schedules: list[str]
) -> dict[str, Any]:
    layouts: list[int] = args["layouts"]
    by_setup: dict[str, Any] = {}
    procs = PeerProcesses(
        2 * max(layouts), [sys.executable, "-m", "peerd.bench.pipeline"], threads=1, log_dir=args["log_dir"]
    )
    job_ids = itertools.count(1)
    try:
        await procs.start()
        for replicas in layouts:  # a layout with fewer replicas runs on the first peer processes
            allocation = Placement.grid(2, replicas)
            for schedule in schedules:
                cfg = job_config(args, schedule, replicas)
                rows = {"unshaped": await measure(procs, cfg, allocation, None, ["none"], args, job_ids)}
                # the matched links follow from this layout's own unshaped step on these cores
                unshaped_s = rows["unshaped"]["none"].get("step_s_median")
                matched = matched_links(args["match"], cfg, replicas, unshaped_s)
                for name, spec in [*links, *matched]:
                    rows[name] = await measure(procs, cfg, allocation, spec, codecs, args, job_ids)
                by_setup[f"2x{replicas}-{schedule}"] = {
                    "layout": f"2 stages x {replicas} replicas: {2 * replicas} peer processes on {_cores()} cores",
                    "global_batch": cfg.global_batch,
                    **_with_regime(rows, cfg, [*links, *matched], replicas),
                }
    finally:
        await procs.close()
    cfg = job_config(args)
    return {
        "model": {**cfg.model.overrides, "params_per_stage": _stage_params(cfg)},
        "batch": {
            "per_replica": args["replica_batch"],
            "micro": cfg.micro_batch_size,
            "seq_len": cfg.data.seq_len,
            "tokens_per_replica_step": args["replica_batch"] * cfg.data.seq_len,
        },
        "steps": {"warmup": args["warmup"], "measured": args["steps"], "repeats": args["train_repeats"]},
        "activation_bytes_per_replica_step_fp32": args["replica_batch"]
        * cfg.data.seq_len
        * cfg.model.gpt().d_model
        * 4,
        "shaped": "links between pipeline neighbours (stage 0 <-> stage 1 of each replica), both directions",
        "why_this_job": (
            "communication-heavy on CPUs: a token is 4*d_model bytes each way but ~72*d_model^2 FLOP per "
            "block, so a narrow model with short sequences maximises link time over compute; "
            "regime.link_over_compute = fp32 link time per direction / unshaped step time says how "
            "link-bound each uncompressed baseline is (the paper's 100 Mbit/s setting: ~4-6); 2x1 gives "
            "each stage its own core, as each stage has its own GPU in the paper; GPipe is the paper's "
            "schedule, --schedules gpipe,1f1b adds 1F1B (both link directions overlap: a faster "
            "uncompressed baseline without link delay)"
        ),
        "by_setup": by_setup,
        # the same regime for every layout: the speed-ups that compare across layouts and with the paper
        "speedup_at_matched_regimes": {
            setup: {
                name: {codec: r.get("speedup_vs_none") for codec, r in row.items() if codec != "none"}
                for name, row in v["by_link"].items()
                if name.startswith("matched-")
            }
            for setup, v in by_setup.items()
        },
    }


async def measure(
    procs: PeerProcesses,
    cfg: TrainConfig,
    allocation: Placement,
    link: LinkSpec | None,
    codecs: list[str],
    args: dict[str, Any],
    job_ids: Iterator[int],
) -> dict[str, Any]:
    """One row: the job under each codec on ``link``, ``--train-repeats`` times, codecs interleaved
    (noise on the shared machine hits them alike)."""
    results: dict[str, list[RunResult]] = {}
    for _ in range(args["train_repeats"]):
        for codec in codecs:
            job = replace(cfg, job=f"bench-{next(job_ids)}", compression=CODECS[codec])
            results.setdefault(codec, []).append(await procs.run(job, allocation, link=link, timeout=900))
    return _row(results, cfg, args["warmup"])


def _row(results: dict[str, list[RunResult]], cfg: TrainConfig, warmup: int) -> dict[str, Any]:
    row = {codec: summarize(rs, cfg, warmup) for codec, rs in results.items()}
    for key, out in (("tokens_per_s", "speedup_vs_none"), ("tokens_per_s_best", "speedup_vs_none_best")):
        base = row["none"].get(key)
        for codec, r in row.items():
            if codec != "none" and base and key in r:
                r[out] = round(r[key] / base, 2)
    return row


def _with_regime(
    rows: dict[str, Any], cfg: TrainConfig, links: list[tuple[str, LinkSpec]], replicas: int
) -> dict[str, Any]:
    """Rows plus how link-bound each uncompressed run is: fp32 link time per step vs the unshaped step time."""
    compute_s = rows["unshaped"]["none"].get("step_s_median")
    ceiling = rows["unshaped"]["none"].get("tokens_per_s")
    for row in rows.values():
        for r in row.values():
            if ceiling and "tokens_per_s" in r:
                r["fraction_of_unshaped"] = round(r["tokens_per_s"] / ceiling, 2)
    per_link = boundary_bytes(cfg, replicas)
    regime: dict[str, Any] = {"unshaped_step_s": compute_s}
    for name, spec in links:
        link_s = per_link * 8 / spec.bandwidth_bps if spec.bandwidth_bps else 0.0
        regime[name] = {
            "mbit_s": round(spec.bandwidth_bps / 1e6, 2) if spec.bandwidth_bps else None,
            "fp32_link_s_per_direction": round(link_s, 4),
            "link_over_compute": round(link_s / compute_s, 2) if compute_s else None,
        }
    return {"regime": regime, "by_link": rows}


def boundary_bytes(cfg: TrainConfig, replicas: int) -> int:
    """fp32 activation bytes one replica's boundary link carries per step in one direction."""
    return cfg.global_batch // replicas * cfg.data.seq_len * cfg.model.gpt().d_model * 4


def matched_links(
    ratios: list[float], cfg: TrainConfig, replicas: int, unshaped_step_s: float | None
) -> list[tuple[str, LinkSpec]]:
    """Per target ``link_over_compute``, the bandwidth at which fp32 link time per direction is that
    multiple of the layout's unshaped step: the same regime for every layout, whatever its cores."""
    if not unshaped_step_s:
        return []
    out = []
    for ratio in ratios:
        bps = boundary_bytes(cfg, replicas) * 8 / (ratio * unshaped_step_s)
        out.append((f"matched-x{ratio:g}", LinkSpec(delay_s=0.0, bandwidth_bps=bps)))
    return out


def _stage_params(cfg: TrainConfig) -> list[int]:
    from peerd.models.costs import stage_costs

    return [c.params for c in stage_costs(cfg.model.gpt(), cfg.layers_per_stage, cfg.data.seq_len)]


@click.command("pipeline")
@click.option(
    "--links", default="1000,100,20+25", show_default=True, help="Link settings: MBIT[+DELAY_MS],..."
)
@click.option(
    "--match",
    default="4",
    show_default=True,
    help="Also run each layout at links matched to these regimes: fp32 link time per direction = "
    "RATIO x that layout's unshaped step (the AC-SGD paper's 100 Mbit/s runs: ~4-6). Empty: none.",
)
@click.option(
    "--codecs",
    default="none,acsgd-fw4-bw8,acsgd-fw2-bw8",
    show_default=True,
    help=f"From {', '.join(CODECS)}.",
)
@click.option("--d-model", default=64, show_default=True)
@click.option(
    "--n-layer", default=2, show_default=True, help="Transformer blocks (split evenly over the 2 stages)."
)
@click.option("--seq-len", default=32, show_default=True)
@click.option("--replica-batch", default=256, show_default=True, help="Sequences per step and replica.")
@click.option("--micro-batch", default=32, show_default=True)
@click.option(
    "--layouts",
    default="2,1",
    show_default=True,
    help="Replicas per stage to measure (2 stages each), e.g. 2,1: 2x2 as in the issue, 2x1 a core per stage.",
)
@click.option(
    "--schedules",
    default="gpipe",
    show_default=True,
    help="Micro-batch schedules to measure (each: every link and codec).",
)
@click.option(
    "--warmup", default=2, show_default=True, help="Unmeasured steps = one epoch (the dataset's size)."
)
@click.option("--steps", default=5, show_default=True, help="Measured steps per run.")
@click.option("--train-repeats", default=2, show_default=True, help="Runs per link and codec (interleaved).")
@click.option("--stream-mib", default=128, show_default=True, help="Bytes per stream-throughput run.")
@click.option(
    "--message-mib", default=4.0, show_default=True, help="Activation message size for the stream test."
)
@click.option("--repeats", default=3, show_default=True, help="Alternating raw/pipeline stream runs.")
@click.option("--part", type=click.Choice(["all", "training", "stream"]), default="all", show_default=True)
@click.option(
    "--log-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Peer process logs (default: discarded).",
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(**args: Any) -> None:
    """Tokens/s of 2-stage pipelines (2x2, 2x1) on shaped links, uncompressed vs AC-SGD; stream vs raw throughput."""
    links = parse_links(args["links"])
    try:
        args["match"] = [float(x) for x in args["match"].split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("--match: comma-separated ratios, e.g. 1,4") from None
    if not all(r > 0 for r in args["match"]):
        raise click.BadParameter("--match: ratios must be > 0")
    codecs = [c.strip() for c in args["codecs"].split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        raise click.BadParameter(f"unknown codec setting {unknown[0]!r} (known: {', '.join(CODECS)})")
    if "none" not in codecs:
        codecs.insert(0, "none")
    if args["warmup"] < 1 or args["steps"] < 1 or args["train_repeats"] < 1:
        raise click.BadParameter("--warmup, --steps and --train-repeats must be >= 1")
    try:
        args["layouts"] = [int(x) for x in args["layouts"].split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("--layouts: comma-separated replica counts, e.g. 2,1") from None
    if not args["layouts"] or not all(1 <= r <= 4 for r in args["layouts"]):
        raise click.BadParameter("--layouts: 1 to 4 replicas each")
    schedules = [x.strip() for x in args["schedules"].split(",") if x.strip()]
    if not schedules or any(x not in available_schedules() for x in schedules):
        raise click.BadParameter(f"--schedules: from {', '.join(available_schedules())}")
    result: dict[str, Any] = {"benchmark": "pipeline", "machine_cores": _cores()}
    started = time.perf_counter()
    if args["part"] in ("all", "training"):
        result["training"] = asyncio.run(training(args, links, codecs, schedules))
    if args["part"] in ("all", "stream"):
        result["stream"] = asyncio.run(
            pipeline_stream(args["stream_mib"], args["message_mib"], args["repeats"])
        )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit_json(result, args["out"])


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":  # a peer process of the training part
    child_main(group_allreduce)
