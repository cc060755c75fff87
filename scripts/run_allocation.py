#!/usr/bin/env python
"""Run a fixed allocation (stages x replicas) of a pipeline training job on loopback peers.

    scripts/run_allocation.py [--config job.yaml] [--replicas 2] [--processes] [--link 20+25]
                              [--until STEP] [--resume]

The job config is a ``peerd.pipeline.config.TrainConfig`` in YAML/JSON (defaults: the tiny
GPT in 2 stages); the allocation is the grid ``len(layers_per_stage)`` x ``--replicas``, one
peer (its own p2pd) per tasklet. In-process by default; ``--processes`` runs one OS process
per peer. ``--link MBIT[+DELAY_MS]`` shapes the links between pipeline neighbours. Prints
one JSON line per completed step of the last stage, then a JSON summary. Exit code 0 when
every tasklet finished, 1 when one failed (typed error in the summary), 2 on a bad config.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict

import click

from peerd.bench.pipeline import group_allreduce, parse_links
from peerd.errors import ConfigError
from peerd.loading import load_dataclass
from peerd.log import setup_logging
from peerd.pipeline.config import TrainConfig
from peerd.pipeline.launch import Placement, RunResult, run_allocation, start_peers, stop_peers
from peerd.pipeline.processes import PeerProcesses, child_main
from peerd.pipeline.worker import StepReport


def _print_step(report: StepReport) -> None:
    if report.loss is not None:
        click.echo(
            json.dumps(
                {
                    "step": report.step,
                    "replica": report.replica,
                    "loss": round(report.loss, 5),
                    "tokens_per_s": round(report.tokens_per_s, 1),
                    "wire_bytes": report.wire_bytes,
                }
            )
        )


async def _in_process(cfg: TrainConfig, allocation: Placement, link, until, resume) -> RunResult:
    shaped = allocation.neighbour_pairs() if link is not None else None
    peers = await start_peers(allocation.stages * allocation.replicas, link=link, shaped=shaped)
    try:
        return await run_allocation(
            cfg,
            allocation,
            peers,
            reducer_factory=group_allreduce,
            until=until,
            resume=resume,
            on_report=_print_step,
        )
    finally:
        await stop_peers(peers)


async def _processes(cfg: TrainConfig, allocation: Placement, link, until, resume, log_dir) -> RunResult:
    procs = PeerProcesses(
        allocation.stages * allocation.replicas, [sys.executable, __file__, "--child"], log_dir=log_dir
    )
    try:
        await procs.start()
        result = await procs.run(cfg, allocation, link=link, until=until, resume=resume, timeout=3600)
    finally:
        await procs.close()
    for report in result.reports:
        _print_step(report)
    return result


@click.command()
@click.option(
    "--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="TrainConfig YAML/JSON."
)
@click.option("--replicas", default=2, show_default=True, help="Data-parallel replicas per stage.")
@click.option("--processes", is_flag=True, help="One OS process per peer instead of one process for all.")
@click.option("--link", default=None, help="Shape pipeline-neighbour links: MBIT[+DELAY_MS].")
@click.option(
    "--until", type=int, default=None, help="Stop after this step (exclusive); checkpoints if configured."
)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint every tasklet has.")
@click.option("--log-dir", default=None, help="Peer process logs (with --processes).")
@click.option("--log-level", default="WARNING", show_default=True)
def main(config_path, replicas, processes, link, until, resume, log_dir, log_level) -> None:
    setup_logging(log_level)
    try:
        cfg = load_dataclass(TrainConfig, config_path) if config_path else TrainConfig()
        cfg.validate()
        allocation = Placement.grid(cfg.num_stages, replicas)
        allocation.validate(cfg, cfg.num_stages * replicas)
        spec = parse_links(link)[0][1] if link else None
    except (ConfigError, click.BadParameter) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if processes:
        result = asyncio.run(_processes(cfg, allocation, spec, until, resume, log_dir))
    else:
        result = asyncio.run(_in_process(cfg, allocation, spec, until, resume))
    losses = result.losses()
    click.echo(
        json.dumps(
            {
                "ok": result.ok,
                "start_step": result.start_step,
                "steps": len(losses),
                "final_loss": losses[-1] if losses else None,
                "errors": [asdict(e) for e in result.errors],
                "streams": result.stats,
            },
            indent=2,
        )
    )
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child_main(group_allreduce)
    else:
        main()
