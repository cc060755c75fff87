"""Prometheus text exposition (format 0.0.4) of a daemon's status view, served on a loopback HTTP port.

The numbers are the ones ``peerd status --json`` shows: peers online, link RTT and bandwidth,
and per job its state, step, loss, tokens per second and bytes on the wire by kind (with the
uncompressed equivalent). The text format is a few lines of string formatting, so peerd
writes it itself rather than depending on ``prometheus-client``. The server answers
``GET /metrics`` (anything else is 404), one request per connection, loopback only: scrape it
locally or through your own exporter/proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any

from peerd.errors import ConfigError
from peerd.log import get_logger

logger = get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.samples: list[tuple[dict[str, str], float]] = []

    def add(self, value: float | None, **labels: Any) -> None:
        if value is not None:
            self.samples.append(({k: str(v) for k, v in labels.items()}, float(value)))

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(
                f"{self.name}{{{inner}}} {_number(value)}" if inner else f"{self.name} {_number(value)}"
            )
        return lines


def render_metrics(view: dict[str, Any]) -> str:
    """The exposition text for a status view (``peers``, ``links``, ``jobs``, as ``peerd status --json``)."""
    names = {p["peer_id"]: p["name"] for p in view.get("peers", [])}
    fams = {
        "online": _Family("peerd_peers_online", "gauge", "Peers of the swarm this daemon sees ONLINE."),
        "peers": _Family("peerd_peers", "gauge", "Peers this daemon sees, by state."),
        "rtt": _Family("peerd_link_rtt_seconds", "gauge", "Measured round-trip time of a link (src -> dst)."),
        "bw": _Family(
            "peerd_link_bandwidth_bits_per_second", "gauge", "Measured upload bandwidth src -> dst."
        ),
        "job": _Family("peerd_job_info", "gauge", "1 per known job, labelled with its name and state."),
        "step": _Family("peerd_job_step", "gauge", "Optimizer steps every tasklet of the job has completed."),
        "steps": _Family("peerd_job_steps", "gauge", "Optimizer steps the job runs in total."),
        "loss": _Family("peerd_job_loss", "gauge", "Training loss of the job's latest step."),
        "tps": _Family("peerd_job_tokens_per_second", "gauge", "Training throughput of the job (tokens/s)."),
        "wire": _Family("peerd_job_wire_bytes_total", "counter", "Bytes the job's tasklets sent, by kind."),
        "raw": _Family(
            "peerd_job_raw_bytes_total", "counter", "What those bytes would have been uncompressed."
        ),
        "cost": _Family(
            "peerd_job_allocation_cost_seconds",
            "gauge",
            "Cost-model seconds per step of the committed allocation.",
        ),
    }
    states: dict[str, int] = {}
    for peer in view.get("peers", []):
        states[peer["state"]] = states.get(peer["state"], 0) + 1
    fams["online"].add(states.get("online", 0))
    for state, n in sorted(states.items()):
        fams["peers"].add(n, state=state)
    for link in view.get("links", []):
        if link.get("status") != "ok":
            continue
        labels = {
            "src": link["src"],
            "dst": link["dst"],
            "src_name": names.get(link["src"], ""),
            "dst_name": names.get(link["dst"], ""),
        }
        if link.get("rtt_ms") is not None:
            fams["rtt"].add(link["rtt_ms"] / 1e3, **labels)
        if link.get("bw_up_mbps") is not None:
            fams["bw"].add(link["bw_up_mbps"] * 1e6, **labels)
    for job in view.get("jobs", []):
        jid = job["job_id"]
        fams["job"].add(1, job=jid, name=job.get("name", ""), state=job["state"], owner=job.get("owner", ""))
        progress = job.get("progress") or {}
        fams["step"].add(progress.get("step"), job=jid)
        fams["steps"].add(progress.get("steps"), job=jid)
        fams["loss"].add(progress.get("loss"), job=jid)
        fams["tps"].add(progress.get("tokens_per_s"), job=jid)
        for kind, n in sorted((progress.get("bytes") or {}).items()):
            family = fams["raw"] if kind.endswith("_raw") else fams["wire"]
            family.add(n, job=jid, kind=kind.removesuffix("_raw"))
        if job.get("allocation"):
            fams["cost"].add(job["allocation"].get("cost"), job=jid)
    lines: list[str] = []
    for fam in fams.values():
        lines += fam.render()
    return "\n".join(lines) + "\n"


class MetricsServer:
    """``GET /metrics`` on ``127.0.0.1:port`` with ``render_metrics(view())``; ``start()`` / ``close()``."""

    def __init__(self, port: int, view: Callable[[], dict[str, Any]], host: str = "127.0.0.1") -> None:
        if not 0 < port < 65536:
            raise ConfigError("metrics_port", f"must be a TCP port 1-65535, got {port}")
        self.host, self.port, self.view = host, port, view
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            raise ConfigError(
                "metrics_port", f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                await _reply(writer, 405, "method not allowed\n")
            elif parts[1].split("?", 1)[0] != "/metrics":
                await _reply(writer, 404, "not found: try /metrics\n")
            else:
                body = render_metrics(self.view())
                await _reply(writer, 200, body, CONTENT_TYPE, head_only=parts[0] == "HEAD")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:  # a bug in a view must not take the daemon down
            logger.exception("metrics request failed")
            with contextlib.suppress(Exception):
                await _reply(writer, 500, "internal error\n")
        finally:
            writer.close()


async def _reply(
    writer: asyncio.StreamWriter,
    status: int,
    body: str,
    ctype: str = "text/plain; charset=utf-8",
    head_only: bool = False,
) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}[status]
    data = body.encode()
    head = f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + (b"" if head_only else data))
    await writer.drain()
