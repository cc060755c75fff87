"""``peerd bench transport``: throughput of peerd's framed Transport vs a raw hivemind binary stream, same bytes.

Two real p2pd daemons on loopback. Baseline: the client writes N bytes to a raw
``call_binary_stream_handler`` stream in 256 KiB memoryview slices; the handler reads
and discards them and answers one byte. peerd: the same N bytes as frames of
each ``--frame-mib`` size through ``Connection.send``; the handler ``recv``s every frame
(materialised in one buffer, as a stage worker needs it) and answers one ack frame.
Runs alternate (raw, peerd, raw, peerd, ...) so machine noise hits both; the report
gives the median Gbit/s of each and their ratio (target >= 0.8). ``pipeline_stream`` (part 2
of ``peerd bench pipeline``) measures the pipeline's reliable stream on top against the same
raw baseline.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import click
import torch

from peerd.bench import emit_json
from peerd.pipeline.frames import raw_payload
from peerd.pipeline.messaging import StreamPair
from peerd.swarm.transport import Connection, Transport, loopback_pair

RAW_PROTOCOL = "peerd-bench/raw/1"
FRAMED_PROTOCOL = "peerd-bench/framed/1"
RAW_CHUNK = 256 * 1024


async def raw_run(p2p_client: Any, server_id: Any, payloads: Sequence[memoryview]) -> float:
    """Seconds to push ``payloads`` (in 256 KiB slices) through a raw hivemind binary stream
    to ``raw_handler`` and get its one-byte answer: the baseline both stream benchmarks use."""
    total = sum(p.nbytes for p in payloads)
    _info, reader, writer = await p2p_client.call_binary_stream_handler(server_id, RAW_PROTOCOL)
    try:
        started = time.perf_counter()
        writer.write(total.to_bytes(8, "big"))
        for payload in payloads:
            for offset in range(0, payload.nbytes, RAW_CHUNK):
                writer.write(payload[offset : offset + RAW_CHUNK])
                await writer.drain()
        await reader.readexactly(1)
        return time.perf_counter() - started
    finally:
        writer.close()


async def raw_handler(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve ``RAW_PROTOCOL``: read the announced byte count, discard it, answer one byte."""
    try:
        total = int.from_bytes(await reader.readexactly(8), "big")
        got = 0
        while got < total:
            data = await reader.read(1 << 20)
            if not data:
                return
            got += len(data)
        writer.write(b"\x01")
        await writer.drain()
    finally:
        writer.close()


def repeated(payload: memoryview, total: int) -> list[memoryview]:
    """``total`` bytes as whole copies of ``payload`` and one cut-off piece (views, no copies)."""
    full, rest = divmod(total, payload.nbytes)
    return [payload] * full + ([payload[:rest]] if rest else [])


async def _framed_handler(conn: Connection) -> None:
    header, _ = await conn.recv(timeout=60)
    total, got = header["total"], 0
    while got < total:
        _header, payload = await conn.recv(timeout=60)
        got += len(payload)
    await conn.send({"kind": "bench.ack", "bytes": got})


async def _framed_run(client: Transport, server_id, payload: memoryview, total: int) -> float:
    conn = await client.connect(server_id, FRAMED_PROTOCOL)
    try:
        started = time.perf_counter()
        await conn.send({"kind": "bench.start", "total": total})
        sent = seq = 0
        while sent < total:
            n = min(payload.nbytes, total - sent)
            await conn.send({"kind": "bench.data", "seq": seq}, payload[:n])
            sent += n
            seq += 1
        header, _ = await conn.recv(timeout=60)
        assert header["bytes"] == total
        return time.perf_counter() - started
    finally:
        await conn.close()


async def _run(total_mib: int, frame_mibs: list[float], repeats: int) -> dict:
    total = total_mib << 20
    largest = memoryview(bytearray(b"\xa5" * int(max(frame_mibs) * (1 << 20))))
    async with loopback_pair() as (a, b, server, client):
        await a.add_binary_stream_handler(RAW_PROTOCOL, raw_handler)
        await server.serve(FRAMED_PROTOCOL, _framed_handler)
        # warm-up: first streams pay for connection set-up in both daemons
        await raw_run(b, a.peer_id, repeated(largest, min(total, 16 << 20)))
        await _framed_run(client, a.peer_id, largest, min(total, 16 << 20))
        rows: list[dict[str, Any]] = []
        for frame_mib in frame_mibs:
            payload = largest[: int(frame_mib * (1 << 20))]
            raw, framed = [], []
            for _ in range(repeats):
                raw.append(total * 8 / await raw_run(b, a.peer_id, repeated(largest, total)) / 1e9)
                framed.append(total * 8 / await _framed_run(client, a.peer_id, payload, total) / 1e9)
            rows.append({"frame_mib": frame_mib, **_versus_raw(raw, framed, "transport")})
    return {
        "benchmark": "transport",
        "what": "loopback throughput: peerd Transport frames vs raw hivemind binary stream, same bytes",
        "config": {"total_mib": total_mib, "repeats": repeats},
        "by_frame_size": rows,
        "min_ratio": min(r["ratio_transport_over_raw"] for r in rows),
        "target_ratio": 0.8,
    }


# ---------------------------------------------------------------- the pipeline stream on top


async def pipeline_stream(total_mib: int, message_mib: float, repeats: int) -> dict[str, Any]:
    """Activation messages through StreamSender -> StreamReceiver vs raw_run of the same bytes (``peerd bench pipeline``)."""
    rows = max(1, int(message_mib * (1 << 20)) // (256 * 512 * 4))
    tensor = torch.randn(rows, 256, 512)  # (B, T, C) activations, fp32
    count = max(1, (total_mib << 20) // (tensor.numel() * 4))
    payloads = [raw_payload(tensor)] * count
    total = count * tensor.numel() * 4
    async with loopback_pair() as (a, b, client, server):
        await b.add_binary_stream_handler(RAW_PROTOCOL, raw_handler)
        pair = StreamPair(client, server, tensor, count)
        await pair.start()
        await raw_run(a, b.peer_id, payloads[:2])  # warm-up: connection set-up in both daemons
        await pair.run(0)
        raw, pipe = [], []
        for i in range(repeats):
            raw.append(total * 8 / await raw_run(a, b.peer_id, payloads) / 1e9)
            pipe.append(total * 8 / await pair.run(i + 1) / 1e9)
        await pair.close()
    return {
        "message_mib": round(tensor.numel() * 4 / (1 << 20), 3),
        "messages": count,
        **_versus_raw(raw, pipe, "pipeline"),
        "target_ratio": 0.8,
    }


def _versus_raw(raw: list[float], other: list[float], name: str) -> dict[str, Any]:
    """Gbit/s per run of the raw baseline and of ``name``, their medians, and the ratio of the medians."""
    raw_med, other_med = statistics.median(raw), statistics.median(other)
    return {
        "raw_gbps": [round(x, 3) for x in raw],
        f"{name}_gbps": [round(x, 3) for x in other],
        "raw_gbps_median": round(raw_med, 3),
        f"{name}_gbps_median": round(other_med, 3),
        f"ratio_{name}_over_raw": round(other_med / raw_med, 3),
    }


@click.command("transport")
@click.option("--total-mib", default=256, show_default=True, help="Bytes per run, MiB.")
@click.option(
    "--frame-mib",
    default="0.25,1,4,16",
    show_default=True,
    help="Payload per Transport frame, MiB (comma list).",
)
@click.option(
    "--repeats", default=5, show_default=True, help="Alternating raw/peerd runs; medians are reported."
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(total_mib: int, frame_mib: str, repeats: int, out: str | None) -> None:
    """Transport throughput vs a raw p2p stream on loopback (ratio; target >= 0.8)."""
    try:
        sizes = [float(x) for x in frame_mib.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {frame_mib!r}") from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter("frame sizes must be > 0")
    emit_json(asyncio.run(_run(total_mib, sizes, repeats)), out)
