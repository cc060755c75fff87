"""``peerd bench links``: link-probe accuracy — measured vs shaped bandwidth and RTT over a grid of emulated links.

Two real p2pd daemons on loopback; both shape their outgoing traffic to the cell's
bandwidth and one-way delay (``LinkShaper.uniform``), one serves probes, the other runs
``LinkProber.probe`` (``--repeats`` times; the cell reports the medians). Each cell gives
measured / shaped for RTT (expected 2 x delay) and for bandwidth in both directions. An unshaped loopback probe is the baseline that shows
the machine itself is much faster than every cell (so the cells measure the shaper's
links, not the host).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import click

from peerd.bench import emit_json
from peerd.swarm.links import LinkProber, ProbeConfig, ProbeResponder
from peerd.swarm.shaper import LinkShaper, LinkSpec
from peerd.swarm.transport import Transport, create_p2p


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}") from None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(measured: float | None, expected: float) -> float | None:
    return None if measured is None else round(measured / expected, 4)


async def _probe_once(p2p_a, p2p_b, spec: LinkSpec | None, config: ProbeConfig) -> dict:
    shaper = (lambda: LinkShaper.uniform(spec)) if spec is not None else (lambda: None)
    server, client = Transport(p2p_a, shaper()), Transport(p2p_b, shaper())
    try:
        await ProbeResponder(server, config).start()
        started = time.perf_counter()
        m = await LinkProber(client, config).probe(p2p_a.peer_id)
        return {
            "status": str(m.status),
            "rtt_ms": m.rtt_ms,
            "up_mbps": m.bw_up_mbps,
            "down_mbps": m.bw_down_mbps,
            "probe_seconds": round(time.perf_counter() - started, 3),
        }
    finally:
        await client.close()
        await server.close()


async def _run(
    bandwidths: list[float], delays: list[float], bulk_seconds: float, pings: int, repeats: int
) -> dict:
    config = ProbeConfig(pings=pings, bulk_seconds=bulk_seconds, bulk_bytes=64 << 20, probe_timeout_s=60.0)
    a = await create_p2p()
    try:
        b = await create_p2p(await a.get_visible_maddrs())
        try:
            baseline = await _probe_once(a, b, None, config)
            cells: list[dict[str, object]] = []
            worst = 0.0
            for mbps in bandwidths:
                for delay_ms in delays:
                    spec = LinkSpec(delay_s=delay_ms / 1e3, bandwidth_bps=mbps * 1e6)
                    runs = [await _probe_once(a, b, spec, config) for _ in range(repeats)]
                    got = {key: _median([r[key] for r in runs]) for key in ("rtt_ms", "up_mbps", "down_mbps")}
                    ratios = {
                        "rtt": _ratio(got["rtt_ms"], 2 * delay_ms),
                        "up": _ratio(got["up_mbps"], mbps),
                        "down": _ratio(got["down_mbps"], mbps),
                    }
                    worst = max([worst, *(abs(r - 1) for r in ratios.values() if r is not None)])
                    cells.append(
                        {
                            "shaped_mbps": mbps,
                            "shaped_one_way_ms": delay_ms,
                            **got,
                            "status": ",".join(sorted({r["status"] for r in runs})),
                            "runs": runs,
                            "ratio": ratios,
                        }
                    )
        finally:
            await b.shutdown()
    finally:
        await a.shutdown()
    return {
        "benchmark": "links",
        "what": "measured / shaped per cell (rtt vs 2x one-way delay; up/down vs shaped Mbit/s); 1.0 is exact",
        "config": {
            "pings": pings,
            "bulk_seconds_per_direction": bulk_seconds,
            "frame_bytes": config.frame_bytes,
            "repeats_per_cell": repeats,
        },
        "baseline_unshaped_loopback": baseline,
        "cells": cells,
        "worst_abs_ratio_error": round(worst, 4),
    }


@click.command("links")
@click.option(
    "--bandwidths", default="5,20,100", show_default=True, help="Shaped bandwidths, Mbit/s (comma list)."
)
@click.option(
    "--delays", default="10,50,150", show_default=True, help="Shaped one-way delays, ms (comma list)."
)
@click.option(
    "--bulk-seconds", default=1.0, show_default=True, help="Bulk transfer budget per direction per probe."
)
@click.option("--pings", default=7, show_default=True, help="Round trips per probe (median).")
@click.option(
    "--repeats", default=3, show_default=True, help="Probes per cell; the cell reports their median."
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(
    bandwidths: str, delays: str, bulk_seconds: float, pings: int, repeats: int, out: str | None
) -> None:
    """Link-probe accuracy over a grid of shaped links (two real p2pd daemons on loopback)."""
    if repeats < 1:
        raise click.BadParameter("--repeats must be >= 1")
    result = asyncio.run(_run(_floats(bandwidths), _floats(delays), bulk_seconds, pings, repeats))
    emit_json(result, out)
