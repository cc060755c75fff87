"""Prometheus metrics of a daemon's status view, served by ``prometheus_client`` on a loopback HTTP port.

The numbers are the ones ``peerd status --json`` shows: peers online, link RTT and bandwidth,
and per job its state, step, loss, held-out loss, tokens per second and bytes on the wire by kind (with the
uncompressed equivalent; the job numbers come from ``peerd.jobs.views``). ``StatusCollector``
reads the live view at every scrape, nothing is kept between scrapes. prometheus_client's
server answers in its own thread while the view belongs to the daemon's event loop, so
``MetricsServer`` reads it on that loop. Loopback only: scrape it locally or through your own
exporter/proxy. Any GET path answers with the metrics (prometheus_client's choice).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from peerd.errors import ConfigError
from peerd.log import get_logger

logger = get_logger(__name__)

VIEW_TIMEOUT_S = 5.0  # a scrape waits this long for the event loop to hand over the view
LINK_LABELS = ["src", "dst", "src_name", "dst_name"]


def _add(family: GaugeMetricFamily | CounterMetricFamily, value: float | None, *labels: str) -> None:
    if value is not None:
        family.add_metric(list(labels), float(value))


class StatusCollector(Collector):
    """Yields the peerd_* series of ``view()`` (``peers``, ``links``, ``jobs``, as ``peerd status --json``)."""

    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view()
        yield from self._peers(view)
        yield from self._jobs(view.get("jobs", []))
        yield from self._rl_jobs(view.get("jobs", []))
        yield from self._refusals(view.get("refusals") or {})

    def _refusals(self, refusals: dict[str, Any]) -> Iterator[Metric]:
        """What this daemon refused from other peers, by layer and code (``peerd.swarm.rejections``)."""
        family = CounterMetricFamily(
            "peerd_refusals",
            "Streams and records this daemon refused or rejected from other peers, by layer and error code.",
            labels=["layer", "code"],
        )
        for layer, counts in sorted(refusals.items()):
            if isinstance(counts, dict):
                for code, n in sorted(counts.items()):
                    _add(family, n, layer, code)
        yield family
        if "bans" in refusals:
            yield CounterMetricFamily(
                "peerd_bans",
                "Bans this daemon issued to peers after garbage or exceeded limits.",
                value=refusals["bans"],
            )

    def _peers(self, view: dict[str, Any]) -> Iterator[Metric]:
        states: dict[str, int] = {}
        for peer in view.get("peers", []):
            states[peer["state"]] = states.get(peer["state"], 0) + 1
        yield GaugeMetricFamily(
            "peerd_peers_online", "Peers of the swarm this daemon sees ONLINE.", value=states.get("online", 0)
        )
        peers = GaugeMetricFamily("peerd_peers", "Peers this daemon sees, by state.", labels=["state"])
        for state, n in sorted(states.items()):
            _add(peers, n, state)
        yield peers
        rtt = GaugeMetricFamily(
            "peerd_link_rtt_seconds", "Measured round-trip time of a link (src -> dst).", labels=LINK_LABELS
        )
        bw = GaugeMetricFamily(
            "peerd_link_bandwidth_bits_per_second",
            "Measured upload bandwidth src -> dst.",
            labels=LINK_LABELS,
        )
        names = {p["peer_id"]: p["name"] for p in view.get("peers", [])}
        for link in view.get("links", []):
            if link.get("status") != "ok":
                continue
            ends = (link["src"], link["dst"], names.get(link["src"], ""), names.get(link["dst"], ""))
            if link.get("rtt_ms") is not None:
                _add(rtt, link["rtt_ms"] / 1e3, *ends)
            if link.get("bw_up_mbps") is not None:
                _add(bw, link["bw_up_mbps"] * 1e6, *ends)
        yield rtt
        yield bw

    def _jobs(self, jobs: list[dict[str, Any]]) -> Iterator[Metric]:
        def gauge(name: str, help_text: str, labels: tuple[str, ...] = ("job",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_text, labels=list(labels))

        info = gauge(
            "peerd_job_info",
            "1 per known job, labelled with its name and state.",
            ("job", "name", "state", "owner"),
        )
        step = gauge("peerd_job_step", "Optimizer steps every tasklet of the job has completed.")
        steps = gauge("peerd_job_steps", "Optimizer steps the job runs in total.")
        loss = gauge("peerd_job_loss", "Training loss of the job's latest step.")
        val_loss = gauge(
            "peerd_job_val_loss",
            "Loss on the job's held-out windows (data.validation) at its latest evaluation.",
        )
        val_step = gauge(
            "peerd_job_val_step", "Steps the job had completed at its latest held-out evaluation."
        )
        tps = gauge("peerd_job_tokens_per_second", "Training throughput of the job (tokens/s).")
        wire = CounterMetricFamily(
            "peerd_job_wire_bytes", "Bytes the job's tasklets sent, by kind.", labels=["job", "kind"]
        )
        raw = CounterMetricFamily(
            "peerd_job_raw_bytes", "What those bytes would have been uncompressed.", labels=["job", "kind"]
        )
        cost = gauge(
            "peerd_job_allocation_cost_seconds", "Cost-model seconds per step of the committed allocation."
        )
        tasklets = gauge("peerd_job_tasklets", "Tasklets (stage replicas) of the committed allocation.")
        spares = gauge("peerd_job_spares", "Roster peers the committed allocation keeps as spares.")
        epoch = gauge("peerd_job_epoch", "Planning epoch of the committed allocation.")
        replans = CounterMetricFamily(
            "peerd_job_replans", "Re-plans this daemon started for the job.", labels=["job"]
        )
        suspects = gauge("peerd_job_suspected_peers", "Peers the job's tasklets report as failing.")
        recovery = gauge(
            "peerd_job_last_recovery_seconds",
            "Seconds this peer's tasklet took to resume after the latest commit (state loaded).",
        )
        for job in jobs:
            jid = job["job_id"]
            _add(info, 1, jid, job.get("name", ""), job["state"], job.get("owner", ""))
            progress = job.get("progress") or {}
            _add(step, progress.get("step"), jid)  # None (unknown: no tasklet record left) is no sample
            _add(steps, progress.get("steps"), jid)
            _add(loss, progress.get("loss"), jid)
            held_out = progress.get("val_losses") or []
            if held_out:
                _add(val_step, held_out[-1][0], jid)
                _add(val_loss, held_out[-1][1], jid)
            _add(tps, progress.get("tokens_per_s"), jid)
            for kind, n in sorted((progress.get("bytes") or {}).items()):
                _add(raw if kind.endswith("_raw") else wire, n, jid, kind.removesuffix("_raw"))
            alloc = job.get("allocation")
            if alloc:
                _add(cost, alloc.get("cost"), jid)
                _add(tasklets, sum(len(stage) for stage in alloc.get("stages") or []), jid)
                _add(spares, len(alloc.get("spares") or []), jid)
            churn = job.get("churn")
            if churn:
                _add(epoch, churn.get("epoch"), jid)
                _add(replans, len(churn.get("replans") or []), jid)
                _add(suspects, len(churn.get("suspects") or []), jid)
            recoveries = (job.get("tasklet") or {}).get("recoveries") or []
            if recoveries:
                _add(recovery, recoveries[-1].get("seconds"), jid)
        yield from (
            info,
            step,
            steps,
            loss,
            val_loss,
            val_step,
            tps,
            wire,
            raw,
            cost,
            tasklets,
            spares,
            epoch,
            replans,
            suspects,
            recovery,
        )

    def _rl_jobs(self, jobs: list[dict[str, Any]]) -> Iterator[Metric]:
        """GRPO's figures of ``rl`` jobs (the trainer's progress record, ``progress.rl`` in the view)."""
        latest = {
            "reward_mean": ("peerd_job_reward_mean", "Mean reward of the latest iteration's completions."),
            "pass_rate": (
                "peerd_job_pass_rate",
                "Share of the latest iteration's completions that are correct.",
            ),
            "kl": ("peerd_job_kl", "Mean k3 KL of the policy to the reference, latest iteration."),
            "kl_max": ("peerd_job_kl_max", "Largest mean k3 KL to the reference of any iteration so far."),
            "response_len": (
                "peerd_job_response_tokens",
                "Mean completion length in tokens, latest iteration.",
            ),
            "rollouts_per_s": ("peerd_job_rollouts_per_second", "Completions trained on per second."),
            "version": ("peerd_job_policy_version", "Policy version the trainer publishes."),
        }
        totals = {
            "weight_sync_bytes": ("peerd_job_weight_sync_bytes", "Policy bytes served to rollout peers."),
            "shards_missing": (
                "peerd_job_rollout_shards_missing",
                "Rollout shards the trainer stopped waiting for.",
            ),
        }
        gauges = {k: GaugeMetricFamily(n, h, labels=["job"]) for k, (n, h) in latest.items()}
        counters = {k: CounterMetricFamily(n, h, labels=["job"]) for k, (n, h) in totals.items()}
        dropped = CounterMetricFamily(
            "peerd_job_rollouts_dropped",
            "Completions refused: stale (over the bound) or late.",
            labels=["job", "why"],
        )
        staleness = GaugeMetricFamily(
            "peerd_job_rollout_staleness",
            "Completions trained on, by their policy-version lag.",
            labels=["job", "lag"],
        )
        for job in jobs:
            rl = (job.get("progress") or {}).get("rl")
            if not rl:
                continue
            jid = job["job_id"]
            for key, family in gauges.items():
                _add(family, rl.get(key), jid)
            for key, counter in counters.items():
                _add(counter, rl.get(key), jid)
            _add(dropped, rl.get("dropped_stale"), jid, "stale")
            _add(dropped, rl.get("dropped_late"), jid, "late")
            for lag, n in rl.get("staleness") or []:
                _add(staleness, n, jid, str(lag))
        yield from (*gauges.values(), *counters.values(), dropped, staleness)


class MetricsServer:
    """``GET /metrics`` on ``127.0.0.1:port`` with the series of ``view()``; ``start()`` / ``close()``."""

    def __init__(
        self,
        port: int,
        view: Callable[[], dict[str, Any]],
        host: str = "127.0.0.1",
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``refresh``: awaited before each scrape reads ``view()`` (counts another process keeps)."""
        if not 0 < port < 65536:
            raise ConfigError("metrics_port", f"must be a TCP port 1-65535, got {port}")
        self.host, self.port, self.view, self.refresh = host, port, view, refresh
        self._httpd: WSGIServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        async def read() -> dict[str, Any]:
            if self.refresh is not None:
                await self.refresh()
            return self.view()

        def on_loop() -> dict[str, Any]:  # runs in the HTTP server's thread
            return asyncio.run_coroutine_threadsafe(read(), loop).result(VIEW_TIMEOUT_S)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(on_loop))
        try:
            self._httpd, _ = start_http_server(self.port, self.host, registry)
        except OSError as exc:
            raise ConfigError(
                "metrics_port", f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            await asyncio.get_running_loop().run_in_executor(None, httpd.shutdown)  # waits out a poll
            httpd.server_close()
