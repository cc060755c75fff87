"""The Prometheus text exposition of a status view, and the loopback HTTP endpoint that serves it."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from peerd.errors import ConfigError
from peerd.jobs.metrics import MetricsServer, render_metrics

VIEW = {
    "peers": [
        {"peer_id": "QmA", "name": 'peer"0', "state": "online"},
        {"peer_id": "QmB", "name": "peer1", "state": "online"},
        {"peer_id": "QmC", "name": "peer2", "state": "offline"},
    ],
    "links": [
        {"src": "QmA", "dst": "QmB", "status": "ok", "rtt_ms": 1.5, "bw_up_mbps": 900.0},
        {"src": "QmB", "dst": "QmA", "status": "timeout", "rtt_ms": None, "bw_up_mbps": None},
    ],
    "jobs": [
        {
            "job_id": "ab" * 16,
            "name": "demo\nline",
            "owner": "QmA",
            "state": "running",
            "progress": {
                "step": 7,
                "steps": 120,
                "loss": 3.25,
                "tokens_per_s": 1000.5,
                "bytes": {"activations": 10, "activations_raw": 80},
            },
            "allocation": {"cost": 0.5},
        },
        {
            "job_id": "cd" * 16,
            "name": "",
            "owner": "QmB",
            "state": "pending",
            "progress": {"step": 0, "loss": None},
        },
    ],
}
SAMPLE = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? (-?[0-9.e+]+|NaN|[+-]Inf)$')


def test_exposition_format_is_well_formed_and_complete() -> None:
    text = render_metrics(VIEW)
    assert text.endswith("\n")
    families = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter") and name not in families
            families.add(name)
        elif not line.startswith("# HELP "):
            assert SAMPLE.match(line), line
    assert "peerd_peers_online 2" in text
    assert 'peerd_peers{state="offline"} 1' in text
    assert 'peerd_link_rtt_seconds{dst="QmB",dst_name="peer1",src="QmA",src_name="peer\\"0"} 0.0015' in text
    assert 'peerd_link_bandwidth_bits_per_second{dst="QmB"' in text and "900000000" in text
    job = "ab" * 16
    assert f'peerd_job_step{{job="{job}"}} 7' in text
    assert f'peerd_job_loss{{job="{job}"}} 3.25' in text
    assert f'peerd_job_wire_bytes_total{{job="{job}",kind="activations"}} 10' in text
    assert f'peerd_job_raw_bytes_total{{job="{job}",kind="activations"}} 80' in text
    assert 'name="demo\\nline"' in text  # newlines in labels are escaped
    assert f'peerd_job_loss{{job="{"cd" * 16}"}}' not in text  # no loss yet: no sample
    assert text.count("# TYPE peerd_link_rtt_seconds") == 1 and text.count("peerd_link_rtt_seconds{") == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _get(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_http_endpoint_serves_metrics_only() -> None:
    async def scenario() -> None:
        port = _free_port()
        server = MetricsServer(port, lambda: VIEW)
        await server.start()
        try:
            ok = await _get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = ok.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.0 200") and b"version=0.0.4" in head
            assert b"peerd_peers_online 2" in body and f"Content-Length: {len(body)}".encode() in head
            assert (await _get(port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 404")
            assert (await _get(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 405")
            head_only = await _get(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
            assert head_only.startswith(b"HTTP/1.0 200") and head_only.endswith(b"\r\n\r\n")
            with pytest.raises(ConfigError):  # the port is taken: a typed error, not a crash
                await MetricsServer(port, lambda: VIEW).start()
        finally:
            await server.close()

    asyncio.run(scenario())
    with pytest.raises(ConfigError):
        MetricsServer(0, lambda: VIEW)
