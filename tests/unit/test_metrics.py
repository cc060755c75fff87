"""The Prometheus series of a status view, and the loopback HTTP endpoint that serves them."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peerd.errors import ConfigError
from peerd.metrics import MetricsServer, StatusCollector

JOB, IDLE, LATE = "ab" * 16, "cd" * 16, "ef" * 16
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
            "job_id": JOB,
            "name": "demo\nline",
            "owner": "QmA",
            "state": "running",
            "progress": {
                "step": 7,
                "steps": 120,
                "loss": 3.25,
                "val_losses": [[5, 3.5], [7, 3.375]],
                "tokens_per_s": 1000.5,
                "bytes": {"activations": 10, "activations_raw": 80},
            },
            "allocation": {"cost": 0.5, "stages": [["QmA", "QmB"], ["QmC", "QmD"]], "spares": ["QmE"]},
            "churn": {"epoch": 3, "replans": [{"cause": "peer QmF left the swarm"}], "suspects": ["QmF"]},
            "tasklet": {"recoveries": [{"seconds": 0.0}, {"seconds": 4.5}]},
        },
        {
            # a job that ended before this daemon joined, its tasklet records gone: step unknown
            "job_id": LATE,
            "name": "old",
            "owner": "QmC",
            "state": "done",
            "progress": {"step": None, "steps": 120},
        },
        {
            "job_id": IDLE,
            "name": "",
            "owner": "QmB",
            "state": "pending",
            "progress": {"step": 0, "loss": None},
        },
    ],
    # peerd.swarm.rejections: what this daemon refused from other peers
    "refusals": {
        "streams": {"BANNED": 2},
        "handlers": {"MALFORMED": 3, "STALE": 1},
        "dht_records": {"BAD_SIGNATURE": 4},
        "job_records": {},
        "bans": 1,
        "total": 10,
    },
}
LINK = {"src": "QmA", "dst": "QmB", "src_name": 'peer"0', "dst_name": "peer1"}
# every series the endpoint exports: (name, labels) -> value
EXPECTED = {
    ("peerd_peers_online", ()): 2,
    ("peerd_peers", (("state", "offline"),)): 1,
    ("peerd_peers", (("state", "online"),)): 2,
    ("peerd_link_rtt_seconds", tuple(LINK.items())): 0.0015,
    ("peerd_link_bandwidth_bits_per_second", tuple(LINK.items())): 9e8,
    ("peerd_job_info", (("job", JOB), ("name", "demo\nline"), ("state", "running"), ("owner", "QmA"))): 1,
    ("peerd_job_info", (("job", IDLE), ("name", ""), ("state", "pending"), ("owner", "QmB"))): 1,
    ("peerd_job_step", (("job", JOB),)): 7,
    ("peerd_job_step", (("job", IDLE),)): 0,
    ("peerd_job_steps", (("job", JOB),)): 120,
    ("peerd_job_loss", (("job", JOB),)): 3.25,  # the idle job has no loss yet: no sample
    ("peerd_job_val_loss", (("job", JOB),)): 3.375,  # the latest held-out evaluation
    ("peerd_job_val_step", (("job", JOB),)): 7,
    ("peerd_job_tokens_per_second", (("job", JOB),)): 1000.5,
    ("peerd_job_wire_bytes_total", (("job", JOB), ("kind", "activations"))): 10,
    ("peerd_job_raw_bytes_total", (("job", JOB), ("kind", "activations"))): 80,
    ("peerd_job_allocation_cost_seconds", (("job", JOB),)): 0.5,
    ("peerd_job_tasklets", (("job", JOB),)): 4,
    ("peerd_job_spares", (("job", JOB),)): 1,
    ("peerd_job_epoch", (("job", JOB),)): 3,
    ("peerd_job_replans_total", (("job", JOB),)): 1,
    ("peerd_job_suspected_peers", (("job", JOB),)): 1,
    ("peerd_job_last_recovery_seconds", (("job", JOB),)): 4.5,
    ("peerd_job_info", (("job", LATE), ("name", "old"), ("state", "done"), ("owner", "QmC"))): 1,
    ("peerd_job_steps", (("job", LATE),)): 120,  # and no peerd_job_step sample: unknown is not 0
    ("peerd_refusals_total", (("layer", "streams"), ("code", "BANNED"))): 2,
    ("peerd_refusals_total", (("layer", "handlers"), ("code", "MALFORMED"))): 3,
    ("peerd_refusals_total", (("layer", "handlers"), ("code", "STALE"))): 1,
    ("peerd_refusals_total", (("layer", "dht_records"), ("code", "BAD_SIGNATURE"))): 4,
    ("peerd_bans_total", ()): 1,
}
COUNTERS = {
    "peerd_job_wire_bytes",
    "peerd_job_raw_bytes",
    "peerd_job_replans",
    "peerd_refusals",
    "peerd_bans",
    "peerd_job_weight_sync_bytes",
    "peerd_job_rollout_shards_missing",
    "peerd_job_rollouts_dropped",
}


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type == ("counter" if family.name in COUNTERS else "gauge"), family.name
        assert family.documentation
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out
            out[key] = s.value
    return out


def test_every_series_of_a_status_view() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: VIEW))
    text = generate_latest(registry).decode()
    assert series(text) == {(name, tuple(sorted(labels))): v for (name, labels), v in EXPECTED.items()}
    assert 'name="demo\\nline"' in text and 'src_name="peer\\"0"' in text  # label values are escaped


def test_an_empty_view_exports_zero_peers_and_no_job_samples() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: {}))
    assert series(generate_latest(registry).decode()) == {("peerd_peers_online", ()): 0}


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


def test_http_endpoint_serves_the_live_view() -> None:
    async def scenario() -> None:
        port = _free_port()
        view = {"peers": VIEW["peers"][:1]}
        server = MetricsServer(port, lambda: view)
        await server.start()
        try:
            ok = await _get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, body = ok.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.0 200") and b"version=0.0.4" in head
            assert series(body.decode())[("peerd_peers_online", ())] == 1
            view = VIEW  # read at every scrape, on this event loop
            again = await _get(port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert series(again.split(b"\r\n\r\n", 1)[1].decode())[("peerd_peers_online", ())] == 2
            assert (await _get(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 405")
            with pytest.raises(ConfigError):  # the port is taken: a typed error, not a crash
                await MetricsServer(port, lambda: VIEW).start()
        finally:
            await server.close()
        with pytest.raises(OSError):  # closed: nothing listens any more
            await _get(port, b"GET /metrics HTTP/1.1\r\n\r\n")

    asyncio.run(scenario())
    with pytest.raises(ConfigError):
        MetricsServer(0, lambda: VIEW)
