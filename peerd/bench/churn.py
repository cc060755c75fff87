"""``peerd bench churn``: what a failure costs a running job, per kind, on real daemons on loopback.

A local swarm (8 daemons by default) trains one small uncompressed job of 3 stages x 2
replicas with two spares; then, one after the other, the failure kinds strike:

- ``replica``: SIGKILL a non-bootstrap peer of one stage (its replica survives);
- ``leave``: a peer of another stage leaves gracefully (SIGTERM: it hands its tasklet over);
- ``bootstrap``: SIGKILL the first peer (the one every other daemon joined through, and the
  job's owner); newcomers join through a survivor;
- ``stage``: SIGKILL both peers of one stage at once (no replica left: the job resumes from
  the checkpoint copies other peers keep).

New daemons join between failures so the job always has spares. For each failure the JSON
gives the seconds until the job trained a step past the one the failure broke (link- and
compute-bound on loopback: the planning windows and the state transfer dominate), the steps
lost (the job's step at the failure minus the step it resumed from) and the epoch. Beside
them: state-transfer throughput against a raw p2p stream of the same bytes (same run), and
the cost-model seconds per step of a repaired allocation against a freshly searched one on
the paper's scenario (pure, deterministic for the seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from peerd.bench import emit_json
from peerd.errors import ErrorCode, PeerdError
from peerd.localswarm import LocalPeer, LocalSwarm, converged
from peerd.sched.allocation import Allocation

CHURN_SPEC: dict[str, Any] = {
    "name": "churn",
    "kind": "pretrain",
    "model": {"preset": "tiny", "seed": 0},
    "data": {"source": "builtin", "seq_len": 32, "max_bytes": 262144},
    "steps": 80,
    "global_batch": 8,
    "micro_batch": 2,
    "optimizer": {"name": "adamw", "lr": 0.003},
    "parallel": {"d_pp": 3, "d_dp": 2},
    "compression": {"forward": "none", "forward_bits": None, "backward_bits": None, "gradient_bits": None},
    "checkpoint_interval": 5,
    "min_peers": 6,
    "max_peers": 8,
    "planning": {"time_budget_s": 3, "max_skew_s": 1.0},
}
"""A job every test machine can train in a minute: the tiny GPT, uncompressed (exact replays)."""

SWARM_OPTIONS = {
    "record_ttl": 10.0,
    "refresh_interval": 2.0,
    "probe_interval": 4.0,
    "probe_budget": 5,
    "startup_timeout": 30.0,
    "shutdown_timeout": 10.0,
    "device": "cpu",
    "leave_grace_s": 60.0,
}

Views = dict[str, dict[str, Any]]
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d ")  # peerd.log's records start with their date
WARNING_LINES = 12  # per daemon, in a timed-out wait's error
MIN_VIEWS = 4  # daemons whose views must agree before a wait counts as done
SCENARIO = "mixed-gpus.yaml"  # the repaired-vs-fresh comparison's cluster (configs/scenarios/)


class SwarmJob:
    """One job on a ``LocalSwarm``, seen through every live daemon's ``job_status``."""

    def __init__(self, swarm: LocalSwarm, job: str, *, min_views: int = MIN_VIEWS) -> None:
        self.swarm, self.job = swarm, job
        self.min_views = min_views  # daemons whose views must agree that the job trains again
        self.last: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}  # name -> the job's reason in that daemon's last view

    def views(self) -> Views:
        """name -> job view of every live daemon that knows the job and its allocation.

        A daemon without an allocation (one that joined while its DHT lagged, or has not read
        the commit yet) has nothing to say about training; the others agree from public records.
        """
        out = {}
        for peer in self.swarm.live_peers():
            with contextlib.suppress(PeerdError):
                view = peer.control().call("job_status", job_id=self.job)
                if "allocation" in view:
                    out[peer.name] = view
        self.last = {
            n: (v["state"], v["progress"]["step"], (v.get("allocation") or {}).get("epoch"))
            for n, v in out.items()
        }
        self.reasons = {n: v["reason"] for n, v in out.items() if v.get("reason")}
        return out

    def wait(self, predicate: Callable[[Views], bool], timeout: float, what: str) -> Views:
        """Poll ``views()`` until ``predicate``; PeerdError(TIMEOUT) naming ``what`` and the last views."""
        deadline = time.monotonic() + timeout
        while True:
            views = self.views()
            if views and predicate(views):
                return views
            if time.monotonic() > deadline:
                raise PeerdError(
                    f"timed out after {timeout:.0f} s waiting for {what}; last views {self.last}"
                    f"; reasons {self.reasons}; the daemons' last warnings:\n{self.warnings()}",
                    code=ErrorCode.TIMEOUT,
                )
            time.sleep(0.5)

    def warnings(self, per_peer: int = WARNING_LINES) -> str:
        """The last WARNING/ERROR lines (and tracebacks) of every daemon's log: why a wait failed."""
        out = []
        for peer in self.swarm.peers:
            try:
                lines = peer.log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            flagged, keep = [], False
            for line in lines:
                if LOG_RECORD.match(line):  # a new record; the lines that follow belong to it
                    keep = " WARN" in line or " ERROR" in line
                if keep:
                    flagged.append(line)
            out += [f"{peer.name}: {ln}" for ln in flagged[-per_peer:]]
        return "\n".join(out) or "(none)"

    def peer_of(self, peer_id: str) -> LocalPeer | None:
        return next(
            (p for p in self.swarm.live_peers() if p.info is not None and p.info.peer_id == peer_id), None
        )

    def strike(self, kind: str, stage: int, timeout: float = 180.0) -> dict[str, Any]:
        """One failure of ``kind`` on ``stage``'s peers; waits until the job trains past it.

        Returns the victims, the seconds to recovery, the job's step at the failure, the step
        it resumed from (the newest committed epoch's smallest resume step) and that epoch.
        """
        views = self.views()
        view = next(iter(views.values()))
        epoch, alloc = view["allocation"]["epoch"], allocation_of(view)
        peers = [p for p in (self.peer_of(d) for d in alloc.stages[stage]) if p is not None]
        if kind == "bootstrap":
            first = self.swarm.peers[0]
            if not first.alive:
                raise PeerdError("the bootstrap peer is gone already", code=ErrorCode.CONFIG_INVALID)
            victims = [first]
        elif kind == "stage":
            victims = peers
        else:
            victims = [p for p in peers if p.index != 0][:1]
        if not victims:
            raise PeerdError(f"no peer to strike in stage {stage} ({kind})", code=ErrorCode.CONFIG_INVALID)
        at = min(v["progress"]["step"] for v in views.values())
        started = time.monotonic()
        for victim in victims:
            if kind == "leave":
                assert victim.process is not None
                victim.process.send_signal(signal.SIGTERM)  # a leave: it hands over, then exits by itself
            else:
                self.swarm.kill_peer(victim)
        gone = {v.info.peer_id for v in victims if v.info is not None}

        replan = bool(gone & set(alloc.devices))  # a spare's death needs no re-plan: training goes on

        def trains_again(vs: Views) -> bool:
            return len(vs) >= self.min_views and all(
                (v["allocation"]["epoch"] > epoch or not replan)
                and not gone & set(allocation_of(v).devices)
                and v["state"] in ("running", "done")  # a short job may finish between two polls
                and v["progress"]["step"] > at
                for v in vs.values()
            )

        after = self.wait(trains_again, timeout, f"the job to train again after the {kind} failure")
        seconds = time.monotonic() - started
        new_epoch = max(v["allocation"]["epoch"] for v in after.values())
        resumes = [
            r["resume_step"]
            for v in after.values()
            for r in (v.get("tasklet") or {}).get("recoveries") or []
            if r["epoch"] == new_epoch
        ]
        resumed = min(resumes, default=at)
        return {
            "kind": kind,
            "victims": [v.name for v in victims],
            "replanned": replan,
            "recovery_s": round(seconds, 2),
            "step_at_failure": at,
            "resumed_at": resumed,
            "steps_lost": max(0, at - resumed),
            "epoch": new_epoch,
        }


def allocation_of(view: dict[str, Any]) -> Allocation:
    a = view["allocation"]
    return Allocation.from_plain(a["stages"], a["spares"], a["layers"])


def start_swarm(
    root: Path,
    peers: int,
    options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    peer_options: list[dict[str, Any]] | None = None,
) -> LocalSwarm:
    swarm = LocalSwarm(
        peers,
        root / "s",
        options={**SWARM_OPTIONS, **(options or {})},
        peer_options=peer_options,
        ready_timeout=120,
        env=env,
    )
    swarm.start()
    names = [p.name for p in swarm.peers]
    swarm.wait_until(lambda v: converged(v, names), timeout=120, what="every daemon to measure the others")
    return swarm


def join_through_survivor(
    swarm: LocalSwarm, until: int, options: Callable[[int], dict[str, Any]] | None = None
) -> None:
    """Start daemons (joining through the newest live peer, not the first) until ``until`` run;
    ``options(i)``, when given, goes into the config of the swarm's ``i``-th peer."""
    while len(swarm.live_peers()) < until:
        live = swarm.live_peers()
        through = [live[-1].info.maddrs[0]] if live and live[-1].info is not None else None
        swarm.add_peer(initial_peers=through, options=options(len(swarm.peers)) if options else None)


BENCH_STEPS = 400  # long enough to outlast four failures and their recoveries


def failures(root: Path, peers: int = 8) -> list[dict[str, Any]]:
    """Run the job and the four failure kinds on a fresh local swarm; one JSON row per failure."""
    swarm = start_swarm(root, peers)
    rows = []
    spec = {**CHURN_SPEC, "steps": BENCH_STEPS}
    try:
        job = SwarmJob(swarm, swarm.peers[0].control().call("submit", spec=spec)["job_id"])
        job.wait(
            lambda vs: (
                len(vs) >= peers
                and all(v["state"] == "running" and v["progress"]["step"] >= 6 for v in vs.values())
            ),
            180,
            "the job to train",
        )
        for kind, stage in (("replica", 1), ("leave", 2), ("bootstrap", 0), ("stage", 1)):
            rows.append(job.strike(kind, stage))
            join_through_survivor(swarm, peers)
    finally:
        swarm.close()
    return rows


def repair_vs_fresh(seed: int = 0) -> dict[str, Any]:
    """Cost model: a repaired allocation after one device leaves vs a fresh search, on the paper's scenario."""
    from peerd.sched.planner import plan
    from peerd.sched.repair import repair
    from peerd.sched.scenario import load_scenario

    path = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / SCENARIO
    if not path.is_file():  # an installed wheel has no configs/
        return {"skipped": f"{SCENARIO} is not on this machine"}
    scenario = load_scenario(path)
    first = plan(scenario, "peerd", seed=seed, time_budget=5.0)
    victim = first.allocation.stages[0][0]
    survivors = dataclasses.replace(
        scenario,
        devices=[d for d in scenario.devices if d.id != victim],
        links=[link for link in scenario.links if victim not in (link.src, link.dst)],
    )
    fixed = repair(survivors, first.allocation, "peerd", seed=seed, time_budget=2.0)
    fresh = plan(survivors, "peerd", seed=seed, time_budget=5.0)
    return {
        "scenario": path.name,
        "removed": victim,
        "repaired_s_per_step": round(fixed.total, 6),
        "fresh_s_per_step": round(fresh.total, 6),
        "ratio_repaired_over_fresh": round(fixed.total / fresh.total, 4),
        "repair_note": fixed.note,
    }


def churn(peers: int = 8, *, transfer_mib: int = 16) -> dict[str, Any]:
    from peerd.bench.statesync import statesync_throughput

    with tempfile.TemporaryDirectory(prefix="peerd-churn-") as tmp:
        rows = failures(Path(tmp), peers)
    transfer = asyncio.run(statesync_throughput(transfer_mib, (1,), repeats=3))
    return {
        "benchmark": "churn",
        "regime": "loopback, 2-core shared machine: recovery is bound by the planning windows and detection",
        "job": {
            "steps": BENCH_STEPS,
            **{k: CHURN_SPEC[k] for k in ("parallel", "checkpoint_interval", "min_peers", "max_peers")},
        },
        "failures": rows,
        "state_transfer": {
            "ratio_statesync_over_raw": transfer["min_ratio"],
            "by_chunk_size": transfer["by_chunk_size"],
        },
        "repair_vs_fresh": repair_vs_fresh(),
    }


@click.command("churn")
@click.option("--peers", default=8, show_default=True, help="Daemons in the local swarm (at least 8).")
@click.option(
    "--transfer-mib", default=16, show_default=True, help="State blob for the throughput part, MiB."
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(peers: int, transfer_mib: int, out: str | None) -> None:
    """Recovery time and steps lost per failure kind, state-transfer throughput, repaired vs fresh cost."""
    if peers < 8:
        raise click.BadParameter("the four failure kinds need at least 8 daemons", param_hint="--peers")
    emit_json(churn(peers, transfer_mib=transfer_mib), out)
