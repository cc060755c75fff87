"""``peerd bench averaging``: gradient all-reduce throughput among 2 and 4 loopback peers, fp32 vs 8-bit vs 4-bit.

Real p2pd daemons on loopback (a full mesh), one ``GroupAllReduce`` per member, on plain
loopback and on links shaped by the LinkShaper (``--mbit``, per destination). A step
averages ``--mib`` MiB of fp32 gradients per member; throughput is that size over the
step's wall time (all members run concurrently on this machine's cores, so the codec's
CPU time counts). Baseline, measured in the same run and interleaved with the all-reduce
steps: the same reduce-scatter/all-gather traffic pattern as plain Transport frames
(each member sends every other member a share-sized frame and gets a share-sized frame
back) with no flattening, coding or reduction. Reported per group size and codec: step
seconds, MiB/s, wire bytes per member and step, ratios against fp32 (speed, bytes) and
against the transfer-only baseline.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import click
import torch

from peerd.averaging import GroupAllReduce
from peerd.averaging.partition import share_bounds
from peerd.bench import emit_json
from peerd.errors import ConfigError
from peerd.swarm.shaper import LinkShaper, LinkSpec
from peerd.swarm.transport import Connection, Transport, create_p2p

ECHO_PROTOCOL = "peerd-bench/avg-echo/1"  # + "/<link>": one per link setting


async def _echo(conn: Connection) -> None:
    """Answer every frame with a frame of the same size (what a reducer sends back)."""
    while True:
        _header, payload = await conn.recv(timeout=120)
        await conn.send({"kind": "bench.share"}, payload)


async def _transfer_only(conns: dict[tuple[int, int], Connection], buffers: list[bytearray]) -> float:
    """Seconds for every member i to send member j a share-j-sized frame and get one back, no compute."""
    started = time.perf_counter()
    await asyncio.gather(
        *(conn.request({"kind": "bench.part"}, buffers[j], timeout=120) for (_i, j), conn in conns.items())
    )
    return time.perf_counter() - started


def _gradients(numel: int, seed: int) -> list[torch.Tensor]:
    """A stage-like gradient list: eight tensors of mixed sizes summing to ``numel``."""
    g = torch.Generator().manual_seed(seed)
    cuts = [0, *(numel * k // 8 for k in range(1, 8)), numel]
    return [torch.randn(cuts[k + 1] - cuts[k], generator=g) * 1e-3 for k in range(8)]


async def _bench_group(
    transports: list[Transport], codecs: list[str], numel: int, repeats: int, link: str
) -> list[dict]:
    size = len(transports)
    ids = [t.peer_id for t in transports]
    groups = {
        codec: [
            GroupAllReduce(t, ids, key=f"bench-{link}-{size}-{codec}", compressor=codec, timeout=300)
            for t in transports
        ]
        for codec in codecs
    }
    grads = [_gradients(numel, seed) for seed in range(size)]
    buffers = [bytearray(4 * (end - start)) for start, end in share_bounds(numel, size)]
    times: dict[str, list[float]] = {c: [] for c in [*codecs, "transfer"]}
    wire: dict[str, int] = dict.fromkeys(codecs, 0)
    conns: dict[tuple[int, int], Connection] = {}
    try:
        for i in range(size):
            for j in range(size):
                if i != j:
                    conns[i, j] = await transports[i].connect(
                        transports[j].peer_id, f"{ECHO_PROTOCOL}/{link}", timeout=30
                    )
        for avgs in groups.values():
            for a in avgs:
                await a.start()
        for step in range(repeats + 1):  # step 0 warms up streams, threads and error-feedback buffers
            transfer = await _transfer_only(conns, buffers)
            for codec, avgs in groups.items():
                before = sum(a.stats.bytes_sent for a in avgs)
                started = time.perf_counter()
                await asyncio.gather(*(a.allreduce(step, g) for a, g in zip(avgs, grads, strict=True)))
                elapsed = time.perf_counter() - started
                if step:
                    times[codec].append(elapsed)
                    wire[codec] += sum(a.stats.bytes_sent for a in avgs) - before
            if step:
                times["transfer"].append(transfer)
    finally:
        for conn in conns.values():
            await conn.close()
        for avgs in groups.values():
            for a in avgs:
                await a.close()
    mib = numel * 4 / 2**20
    transfer_med = statistics.median(times["transfer"])
    base_s, base_wire = statistics.median(times[codecs[0]]), wire[codecs[0]]
    rows = []
    for codec in codecs:
        med = statistics.median(times[codec])
        rows.append(
            {
                "link": link,
                "peers": size,
                "codec": codec,
                "step_s": [round(x, 4) for x in times[codec]],
                "step_s_median": round(med, 4),
                "mib_per_s": round(mib / med, 2),
                "wire_bytes_per_member_step": wire[codec] // (size * repeats),
                "wire_ratio_vs_fp32": round(wire[codec] / base_wire, 4),
                "speedup_vs_fp32": round(base_s / med, 3),
                "transfer_only_s_median": round(transfer_med, 4),
                "time_ratio_vs_transfer_only": round(med / transfer_med, 3),
            }
        )
    return rows


async def _run(
    mib: float, peer_counts: list[int], codecs: list[str], repeats: int, mbits: list[float]
) -> dict:
    numel = int(mib * 2**20) // 4
    p2ps: list = []
    rows: list[dict] = []
    try:
        for _ in range(max(peer_counts)):
            known = [m for p in p2ps for m in await p.get_visible_maddrs()]
            p2ps.append(await create_p2p(known))  # each new daemon dials all earlier ones: a full mesh
        for mbit in mbits:
            link = "loopback" if mbit == 0 else f"{mbit:g}mbit"
            shaper = None if mbit == 0 else LinkShaper.uniform(LinkSpec(bandwidth_bps=mbit * 1e6))
            transports = [Transport(p, shaper) for p in p2ps]
            try:
                for t in transports:
                    await t.serve(f"{ECHO_PROTOCOL}/{link}", _echo)
                for size in peer_counts:
                    rows += await _bench_group(transports[:size], codecs, numel, repeats, link)
            finally:
                for t in transports:
                    await t.close()
    finally:
        for p in reversed(p2ps):
            await p.shutdown()
    return {
        "benchmark": "averaging",
        "what": "fp32 gradient MiB averaged per member per second among loopback peers (plain or "
        "shaped links); wire bytes vs fp32; time vs the same traffic without averaging",
        "config": {
            "mib_per_member": mib,
            "peers": peer_counts,
            "codecs": codecs,
            "repeats": repeats,
            "links_mbit": mbits,
        },
        "ideal_wire_ratio": {c: _ideal_ratio(c) for c in codecs},
        "results": rows,
    }


def _ideal_ratio(codec: str) -> float:
    """Bits per element on the wire / 32 for the default quantizer (group of 256, bf16 scales)."""
    if codec in ("none", "fp32"):
        return 1.0
    bits = int(codec.lstrip("q"))
    return round((bits + 16 / 256) / 32, 4)


@click.command("averaging")
@click.option("--mib", default=32.0, show_default=True, help="fp32 gradient MiB per member per step.")
@click.option("--peers", default="2,4", show_default=True, help="Group sizes (comma list).")
@click.option(
    "--codecs", default="none,q8,q4", show_default=True, help="Gradient codecs; the first is the baseline."
)
@click.option(
    "--repeats", default=3, show_default=True, help="Timed steps per configuration (medians reported)."
)
@click.option(
    "--mbit",
    default="0,100",
    show_default=True,
    help="Per-destination link rates emulated by the LinkShaper, Mbit/s (0: plain loopback).",
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(mib: float, peers: str, codecs: str, repeats: int, mbit: str, out: str | None) -> None:
    """All-reduce throughput among loopback peers: fp32 vs quantized with error feedback."""
    try:
        peer_counts = [int(x) for x in peers.split(",") if x.strip()]
        names = [x.strip() for x in codecs.split(",") if x.strip()]
        mbits = [float(x) for x in mbit.split(",") if x.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not peer_counts or min(peer_counts) < 2 or not names or repeats < 1 or mib <= 0:
        raise click.BadParameter("need group sizes >= 2, at least one codec, repeats >= 1, mib > 0")
    if not mbits or min(mbits) < 0:
        raise click.BadParameter("--mbit: rates >= 0 (0 = plain loopback)")
    try:
        result = asyncio.run(_run(mib, peer_counts, names, repeats, mbits))
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    emit_json(result, out)
