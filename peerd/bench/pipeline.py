"""``peerd bench pipeline``: pipeline training throughput on shaped loopback links, uncompressed vs AC-SGD.

Part 1 (``training``): a 2-stage x 2-replica GPT job, one OS process per peer (each its own
p2pd), links between pipeline neighbours shaped to each ``--links`` setting (replica-group
links unshaped, as within a site). Per link setting it runs the job uncompressed and with
every ``--codecs`` setting on the same processes, and reports steady-state tokens/s (after
``--warmup`` steps, one epoch by default, so AC-SGD sends deltas, not first-visit seeds),
the speed-up over uncompressed, the final loss, and bytes on the wire per step per boundary
by direction. Part 2 (``stream``): activation messages through the pipeline stream
(StreamSender -> StreamReceiver, acks, validation, decode) vs a raw hivemind binary stream
carrying the same bytes, alternating runs, medians and their ratio (target >= 0.8).

Default model: a GPT with 2 blocks, d_model 64, 256-token sequences, global batch 64 in
micro-batches of 8. Its activations are 4 MiB per step and boundary in each direction: a
20 Mbit/s link needs ~1.7 s for them, while the compute floor of 4 peer processes sharing 2
CPU cores is ~0.4 s per step. Wider models are compute-bound on such CPUs already at
100 Mbit/s (the GPUs of the AC-SGD paper compute ~1000x faster); ``--d-model`` etc. change it.

Run as a module (``python -m peerd.bench.pipeline``) this file is the peer process.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import click
import torch

from peerd.averaging import GroupAllReduce
from peerd.bench import emit_json
from peerd.bench.transport import RAW_PROTOCOL, raw_handler, raw_run
from peerd.data.config import DataConfig
from peerd.pipeline.codec import CompressionConfig, RawDecoder
from peerd.pipeline.config import ModelSpec, TrainConfig
from peerd.pipeline.frames import KIND_ACT, Expectation, TensorMessage, raw_payload
from peerd.pipeline.launch import Allocation, RunResult
from peerd.pipeline.processes import PeerProcesses, child_main
from peerd.pipeline.sender import StreamSender
from peerd.pipeline.streams import (
    Inbox,
    StreamConfig,
    StreamReceiver,
    StreamStats,
    stage_protocol,
)
from peerd.swarm.shaper import LinkSpec
from peerd.swarm.transport import Transport, create_p2p

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


def job_config(args: dict[str, Any]) -> TrainConfig:
    per_epoch = args["warmup"]  # steps per epoch: the dataset holds exactly warmup global batches
    examples = per_epoch * args["global_batch"]
    return TrainConfig(
        job="bench",
        model=ModelSpec(
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
        global_batch=args["global_batch"],
        micro_batch_size=args["micro_batch"],
        steps=args["warmup"] + args["steps"],
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
    return {
        "tokens_per_s": round(cfg.global_batch * cfg.data.seq_len / step_s, 1),
        "step_s_median": round(step_s, 4),
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
    args: dict[str, Any], links: list[tuple[str, LinkSpec]], codecs: list[str]
) -> dict[str, Any]:
    cfg = job_config(args)
    allocation = Allocation.grid(2, 2)
    rows: dict[str, Any] = {}
    procs = PeerProcesses(
        4, [sys.executable, "-m", "peerd.bench.pipeline"], threads=1, log_dir=args["log_dir"]
    )
    runs = 0
    try:
        await procs.start()
        for name, spec in [("unshaped", None), *links]:
            results: dict[str, list[RunResult]] = {}
            for _ in range(args["train_repeats"]):  # codecs interleaved: noise hits them alike
                for codec in codecs if spec is not None else ["none"]:
                    runs += 1
                    job = replace(cfg, job=f"bench-{runs}", compression=CODECS[codec])
                    results.setdefault(codec, []).append(
                        await procs.run(job, allocation, link=spec, timeout=900)
                    )
            row = {codec: summarize(rs, cfg, args["warmup"]) for codec, rs in results.items()}
            base = row["none"].get("tokens_per_s")
            for codec, r in row.items():
                if codec != "none" and base and "tokens_per_s" in r:
                    r["speedup_vs_none"] = round(r["tokens_per_s"] / base, 2)
            rows[name] = row
        ceiling = rows["unshaped"]["none"].get("tokens_per_s")
        for row in rows.values():
            for r in row.values():
                if ceiling and "tokens_per_s" in r:
                    r["fraction_of_unshaped"] = round(r["tokens_per_s"] / ceiling, 2)
    finally:
        await procs.close()
    return {
        "model": {**cfg.model.overrides, "params_per_stage": _stage_params(cfg)},
        "batch": {"global": cfg.global_batch, "micro": cfg.micro_batch_size, "seq_len": cfg.data.seq_len},
        "steps": {"warmup": args["warmup"], "measured": args["steps"], "repeats": args["train_repeats"]},
        "activation_bytes_per_step_fp32": cfg.global_batch * cfg.data.seq_len * cfg.model.gpt().d_model * 4,
        "shaped": "links between pipeline neighbours (stage 0 <-> stage 1 of each replica), both directions",
        "by_link": rows,
    }


def _stage_params(cfg: TrainConfig) -> list[int]:
    from peerd.models.costs import stage_costs

    return [c.params for c in stage_costs(cfg.model.gpt(), cfg.layers_per_stage, cfg.data.seq_len)]


# ---------------------------------------------------------------- stream throughput


class _StreamPair:
    """A stage-0 sender and a stage-1 receiver on one persistent stream (as between two stage workers)."""

    def __init__(self, client: Transport, server: Transport, tensor: torch.Tensor, count: int) -> None:
        self.client, self.server, self.tensor, self.count = client, server, tensor, count
        self.inbox, self.stats = Inbox(0), StreamStats()
        self.config = StreamConfig(recv_timeout_s=120, ack_timeout_s=120)
        self.protocol = stage_protocol("stream", 1)
        self.payload = raw_payload(tensor)
        self.receiver = StreamReceiver(
            upstream=client.peer_id,
            downstream=None,
            expectations={KIND_ACT: self._expect},
            decoders={KIND_ACT: RawDecoder()},
            inbox=self.inbox,
            stats=self.stats,
            config=self.config,
        )
        self.sender = StreamSender(
            client, server.peer_id, self.protocol, config=self.config, stats=StreamStats()
        )

    def _ids_of(self, step: int, mb: int) -> list[int] | None:
        b = self.tensor.shape[0]
        return list(range(mb * b, (mb + 1) * b)) if 0 <= mb < self.count else None

    def _expect(self, step: int) -> Expectation:
        row = tuple(self.tensor.shape[1:])
        return Expectation("stream", KIND_ACT, 0, "none", "float32", row, (step, step + 1), self._ids_of)

    async def start(self) -> None:
        await self.receiver.serve(self.server, self.protocol)
        await self.sender.start()

    async def run(self, step: int) -> float:
        """Seconds until ``count`` activation messages of step ``step`` are accepted by the receiver."""
        self.inbox.advance(step)
        started = time.perf_counter()
        for mb in range(self.count):
            ids = self._ids_of(step, mb)
            assert ids is not None
            shape = tuple(self.tensor.shape)
            msg = TensorMessage(
                KIND_ACT, "stream", step, mb, 0, tuple(ids), "none", shape, "float32", 0, self.payload.nbytes
            )
            await self.sender.send(msg, self.payload)
        for mb in range(self.count):
            await self.inbox.get(KIND_ACT, step, mb, 120)
        elapsed = time.perf_counter() - started
        await self.sender.flush()
        return elapsed

    async def close(self) -> None:
        await self.sender.close()
        await self.server.stop_serving(self.protocol)


async def stream(total_mib: int, message_mib: float, repeats: int) -> dict[str, Any]:
    rows = max(1, int(message_mib * (1 << 20)) // (256 * 512 * 4))
    tensor = torch.randn(rows, 256, 512)  # (B, T, C) activations, fp32
    count = max(1, (total_mib << 20) // (tensor.numel() * 4))
    payloads = [raw_payload(tensor)] * count
    total = count * tensor.numel() * 4
    a = await create_p2p()
    try:
        b = await create_p2p(await a.get_visible_maddrs())
        client, server = Transport(a), Transport(b)
        try:
            await b.add_binary_stream_handler(RAW_PROTOCOL, raw_handler)
            pair = _StreamPair(client, server, tensor, count)
            await pair.start()
            await raw_run(a, b.peer_id, payloads[:2])  # warm-up: connection set-up in both daemons
            await pair.run(0)
            raw, pipe = [], []
            for i in range(repeats):
                raw.append(total * 8 / await raw_run(a, b.peer_id, payloads) / 1e9)
                pipe.append(total * 8 / await pair.run(i + 1) / 1e9)
            await pair.close()
        finally:
            await client.close()
            await server.close()
            await b.shutdown()
    finally:
        await a.shutdown()
    raw_med, pipe_med = statistics.median(raw), statistics.median(pipe)
    return {
        "message_mib": round(tensor.numel() * 4 / (1 << 20), 3),
        "messages": count,
        "raw_gbps": [round(x, 3) for x in raw],
        "pipeline_gbps": [round(x, 3) for x in pipe],
        "raw_gbps_median": round(raw_med, 3),
        "pipeline_gbps_median": round(pipe_med, 3),
        "ratio_pipeline_over_raw": round(pipe_med / raw_med, 3),
        "target_ratio": 0.8,
    }


@click.command("pipeline")
@click.option(
    "--links", default="1000,100,20+25", show_default=True, help="Link settings: MBIT[+DELAY_MS],..."
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
@click.option("--seq-len", default=256, show_default=True)
@click.option("--global-batch", default=64, show_default=True)
@click.option("--micro-batch", default=8, show_default=True)
@click.option(
    "--warmup", default=3, show_default=True, help="Unmeasured steps = one epoch (the dataset's size)."
)
@click.option("--steps", default=6, show_default=True, help="Measured steps per run.")
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
    """Tokens/s of 2 stages x 2 replicas on shaped links (uncompressed vs AC-SGD) and stream vs raw throughput."""
    links = parse_links(args["links"])
    codecs = [c.strip() for c in args["codecs"].split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        raise click.BadParameter(f"unknown codec setting {unknown[0]!r} (known: {', '.join(CODECS)})")
    if "none" not in codecs:
        codecs.insert(0, "none")
    if args["warmup"] < 1 or args["steps"] < 1 or args["train_repeats"] < 1:
        raise click.BadParameter("--warmup, --steps and --train-repeats must be >= 1")
    result: dict[str, Any] = {"benchmark": "pipeline", "machine_cores": _cores()}
    started = time.perf_counter()
    if args["part"] in ("all", "training"):
        result["training"] = asyncio.run(training(args, links, codecs))
    if args["part"] in ("all", "stream"):
        result["stream"] = asyncio.run(stream(args["stream_mib"], args["message_mib"], args["repeats"]))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    emit_json(result, args["out"])


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":  # a peer process of the training part
    child_main(group_allreduce)
