"""State-transfer throughput (``fetch_state`` from a ``StateServer``) vs a raw hivemind binary stream, same bytes.

Two real p2pd daemons on loopback. Baseline: ``peerd.bench.transport.raw_run``, the blob's
bytes written to a raw ``call_binary_stream_handler`` stream and discarded by the handler.
State sync: the same number of bytes as a packed state fetched chunk by chunk, one request
per chunk, hashed on both sides, assembled into one blob (what a replacement peer does).
Runs alternate (raw, state, raw, state, ...) so machine noise hits both; the JSON gives the
median Gbit/s of each and their ratio per chunk size. ``peerd bench churn`` reports it as
its state-transfer line; ``python -m peerd.bench.statesync`` runs it alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import click
import torch

from peerd.bench import emit_json
from peerd.bench.transport import RAW_PROTOCOL, raw_handler, raw_run
from peerd.pipeline.statesync import StateServer, StateSyncConfig, fetch_state, pack_state
from peerd.swarm.transport import Transport, loopback_pair

JOB = "bench" + "0" * 27  # a job id's shape: 32 characters


def _blob(total_mib: int) -> bytes:
    """A packed state of ``total_mib`` MiB of fp32 weights (random: nothing on the path can shrink it)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.randn((total_mib << 20) // 4, generator=g)
    return pack_state({"module": {"w": weights}, "step": 0})


async def _state_run(client: Transport, holder: Transport, blob: bytes, config: StateSyncConfig) -> float:
    started = time.perf_counter()
    got = await fetch_state(client, [holder.peer_id], JOB, 0, 0, max_bytes=len(blob), config=config)
    elapsed = time.perf_counter() - started
    assert len(got) == len(blob)
    return elapsed


async def statesync_throughput(
    total_mib: int = 64, chunk_mibs: tuple[float, ...] = (1, 4), repeats: int = 3
) -> dict[str, Any]:
    """Median Gbit/s of state transfer and of the raw stream per chunk size, and their ratio."""
    blob = _blob(total_mib)
    view = memoryview(blob)
    rows: list[dict[str, Any]] = []
    async with loopback_pair() as (_a, _b, holder, client):
        await holder.p2p.add_binary_stream_handler(RAW_PROTOCOL, raw_handler)
        configs = [StateSyncConfig(chunk_bytes=int(mib * (1 << 20))) for mib in chunk_mibs]
        server = StateServer(holder, JOB, lambda stage, step: blob, config=configs[0])
        await server.start()
        try:
            await raw_run(
                client.p2p, holder.peer_id, [view[: 8 << 20]]
            )  # warm-up: stream set-up in both daemons
            await _state_run(client, holder, blob, configs[0])
            for mib, config in zip(chunk_mibs, configs, strict=True):
                server.config = config  # the holder serves chunks as large as the client asks for
                raw, state = [], []
                for _ in range(repeats):
                    raw.append(len(blob) * 8 / await raw_run(client.p2p, holder.peer_id, [view]) / 1e9)
                    state.append(len(blob) * 8 / await _state_run(client, holder, blob, config) / 1e9)
                raw_med, state_med = statistics.median(raw), statistics.median(state)
                rows.append(
                    {
                        "chunk_mib": mib,
                        "raw_gbps": [round(x, 3) for x in raw],
                        "statesync_gbps": [round(x, 3) for x in state],
                        "raw_gbps_median": round(raw_med, 3),
                        "statesync_gbps_median": round(state_med, 3),
                        "ratio_statesync_over_raw": round(state_med / raw_med, 3),
                    }
                )
        finally:
            await server.close()
    return {
        "benchmark": "statesync",
        "what": "loopback throughput: fetch_state of a packed stage state vs raw hivemind binary stream, same bytes",
        "config": {"blob_bytes": len(blob), "repeats": repeats},
        "by_chunk_size": rows,
        "min_ratio": min(r["ratio_statesync_over_raw"] for r in rows),
    }


@click.command("statesync")
@click.option("--total-mib", default=64, show_default=True, help="Size of the state blob, MiB.")
@click.option("--chunk-mib", default="1,4", show_default=True, help="Chunk per request, MiB (comma list).")
@click.option(
    "--repeats", default=3, show_default=True, help="Alternating raw/state runs; medians are reported."
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(total_mib: int, chunk_mib: str, repeats: int, out: str | None) -> None:
    """State-transfer throughput vs a raw p2p stream on loopback (ratio)."""
    try:
        sizes = tuple(float(x) for x in chunk_mib.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {chunk_mib!r}") from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter("chunk sizes must be > 0")
    if total_mib < 1 or repeats < 1:
        raise click.BadParameter("--total-mib and --repeats must be >= 1")
    emit_json(asyncio.run(statesync_throughput(total_mib, sizes, repeats)), out)


if __name__ == "__main__":
    command()
