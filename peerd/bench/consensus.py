"""``peerd bench consensus``: planning latency on real daemons, and the quality of the consensus winner.

**Latency** (``--peers 4,8,16``): a local swarm of N ``peerd join`` daemons on loopback; a job
is submitted whose roster must hold all N; each daemon reports when it committed. The
result is the time from the roster closing (epoch start + ``roster_s``, DHT time) to each
peer's commit, beside the protocol's own floor for it (settle + search + exchange: nobody
may vote earlier) as the baseline: ``ratio = measured / floor``. The job is cancelled right
after the commit, so nothing trains. 16 daemons on 2 cores is heavy: the run reports what
it managed (startup and convergence times included) rather than failing the rest.

**Quality** (``--devices 32,64``, in-process, deterministic): a heterogeneous synthetic
cluster as a consensus roster, the job's shared cost model, K islands seeded as the
consensus machine seeds them (hash of job, epoch, peer). (a) consensus: the K islands
exchange their bests every ``--migrate-every`` generations (what the DHT migration does),
the committed allocation is the cheapest final candidate (what round-0 voting picks);
(b) the same K islands isolated; (c) one island with the same total budget (K x the
generations). Ratios < 1 mean the consensus winner is cheaper.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from peerd.bench import emit_json
from peerd.sched.consensus.machine import island_seed


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


# -- latency on real daemons ----------------------------------------------------------------------


def _latency_spec(n: int, skew: float, budget: float) -> dict[str, Any]:
    return {
        "name": f"bench-consensus-{n}",
        "kind": "pretrain",
        "model": {"preset": "tiny"},
        "data": {"seq_len": 32, "max_bytes": 65536},
        "steps": 1,
        "global_batch": 64,
        "micro_batch": 4,
        "optimizer": {"warmup_steps": 0},
        "parallel": {"d_pp": 2, "d_dp": "auto"},
        "min_peers": n,
        "max_peers": n,
        "planning": {"time_budget_s": budget, "max_skew_s": skew},
    }


def _latency(n: int, root: Path, skew: float, budget: float, timeout: float) -> dict[str, Any]:
    from peerd.jobs.records import normalized_spec
    from peerd.jobs.spec import parse_job_spec
    from peerd.localswarm import LocalSwarm, converged

    options = {
        "record_ttl": 30.0,
        "refresh_interval": 5.0,
        "probe_interval": 10.0,
        "probe_budget": 2,
        "startup_timeout": 60.0,
        "shutdown_timeout": 10.0,
        "device": "cpu",
    }
    out: dict[str, Any] = {"peers": n}
    t0 = time.monotonic()
    swarm = LocalSwarm(n, root / f"n{n}", options=options, ready_timeout=300)
    try:
        swarm.start()
        out["startup_s"] = round(time.monotonic() - t0, 1)
        names = [p.name for p in swarm.peers]
        swarm.wait_until(lambda v: converged(v, names, links=False), timeout=timeout, what="membership")
        out["membership_s"] = round(time.monotonic() - t0, 1)
        spec = parse_job_spec(_latency_spec(n, skew, budget))
        owner = swarm.peers[0].control(timeout=60)
        job = owner.call("submit", spec=normalized_spec(spec))["job_id"]
        deadline = time.monotonic() + timeout
        views: dict[str, Any] = {}
        while time.monotonic() < deadline:
            views = {p.name: p.control(timeout=60).call("job_status", job_id=job) for p in swarm.peers}
            if all("commit" in (v.get("planning") or {}) for v in views.values()):
                break
            time.sleep(1.0)
        out["wall_s"] = round(time.monotonic() - t0, 1)
        owner.call("cancel", job_id=job)
        plans = [v.get("planning") or {} for v in views.values()]
        done = [p for p in plans if "commit" in p]
        out["committed"] = len(done)
        if not done:
            out["error"] = f"no commit within {timeout:.0f} s"
            return out
        timing = spec.planning.timing()
        floor = timing.settle_s + timing.search_s + timing.exchange_s
        after_close = [p["committed_at"] - p["roster_closed_at"] for p in done]
        after_votes = [p["committed_at"] - p["votes_opened_at"] for p in done]
        hashes = {p["commit"]["allocation_hash"] for p in done}
        epoch = done[0]["commit"]["epoch"]
        islands = [
            r["best_cost"]
            for p in done
            for r in p["islands"]
            if r["epoch"] == epoch and r.get("best_cost") is not None
        ]
        cost = done[0]["commit"]["cost"]
        out.update(
            same_allocation=len(hashes) == 1,
            epoch=done[0]["commit"]["epoch"],
            round=done[0]["commit"]["round"],
            roster_size=len(done[0]["commit"]["roster"]),
            commit_after_roster_close_s={
                "median": round(statistics.median(after_close), 2),
                "max": round(max(after_close), 2),
            },
            commit_after_votes_open_s={
                "median": round(statistics.median(after_votes), 2),
                "max": round(max(after_votes), 2),
            },
            protocol_floor_s=round(floor, 2),
            ratio_vs_floor=round(statistics.median(after_close) / floor, 3),
            committed_cost=cost,
            best_island_cost=min(islands) if islands else None,
            committed_vs_best_island=round(cost / min(islands), 6) if islands else None,
        )
        return out
    except Exception as exc:  # report what ran; the other sizes still run
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        return out
    finally:
        swarm.close()


# -- quality in process ---------------------------------------------------------------------------


def _quality_spec(n: int) -> dict[str, Any]:
    d_pp = 4
    return {
        "name": f"bench-quality-{n}",
        "kind": "pretrain",
        "model": {
            "preset": "mini",
            "overrides": {"n_layer": 22, "d_model": 1024, "n_head": 16, "max_seq_len": 512},
        },
        "data": {"seq_len": 512},
        "steps": 1000,
        "global_batch": 8 * n,
        "micro_batch": 4,
        "parallel": {"d_pp": d_pp, "d_dp": n // d_pp},
        "compression": {"forward": "acsgd", "forward_bits": 4, "backward_bits": 8, "gradient_bits": 8},
        "min_peers": n,
        "planning": {"time_budget_s": 30, "objective": "peerd"},
    }


def _roster(n: int, seed: int) -> Any:
    from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink
    from peerd.sched.problem import Problem
    from peerd.sched.synthetic import random_cluster

    scenario = random_cluster(n, np.random.default_rng(seed))
    problem = Problem(scenario)
    entries = []
    for i, dev in enumerate(problem.ids):
        links = tuple(
            RosterLink(other, float(problem.delay[i, j]), float(problem.bandwidth[i, j]))
            for j, other in enumerate(problem.ids)
            if j != i
        )
        spec = scenario.devices[scenario.index_of(dev)]
        profile = RosterDevice(spec.tflops, int(spec.memory_gb * 1e9), spec.region)
        entries.append(RosterEntry("bench", 0, dev, 0.0, profile, links))
    return Roster.of(0, entries)


def _quality(n: int, islands: int, generations: int, migrate_every: int, seed: int) -> dict[str, Any]:
    from peerd.jobs.scoring import RosterScorer
    from peerd.jobs.spec import parse_job_spec

    roster = _roster(n, seed)
    scorer = RosterScorer(parse_job_spec(_quality_spec(n)))
    scenario = scorer.scenario(roster)
    job = f"bench-quality-{n}-{seed}"
    seeds = [island_seed(job, 0, p) for p in roster.peers[:islands]]

    def run(group_seeds: list[int], gens: int, migrate: bool) -> tuple[list[float], float]:
        started = time.perf_counter()
        group = [scorer.island(scenario, s, time_budget=60.0) for s in group_seeds]
        for g in range(gens):
            for isl in group:
                isl.step(1)
            if migrate and (g + 1) % migrate_every == 0:
                bests = [isl.best(1)[0] for isl in group]
                for i, isl in enumerate(group):
                    isl.accept([b for j, b in enumerate(bests) if j != i])
        costs = [
            scorer(roster, isl.best(1)[0]) for isl in group
        ]  # re-scored by the shared model, as voters do
        return costs, time.perf_counter() - started

    consensus, t_consensus = run(seeds, generations, migrate=True)
    isolated, t_isolated = run(seeds, generations, migrate=False)
    single, t_single = run(seeds[:1], generations * len(seeds), migrate=False)
    committed = min(consensus)
    return {
        "devices": n,
        "islands": len(seeds),
        "generations_per_island": generations,
        "migrate_every": migrate_every,
        "committed_cost": committed,
        "best_isolated_island_cost": min(isolated),
        "median_isolated_island_cost": statistics.median(isolated),
        "single_island_same_budget_cost": single[0],
        "committed_vs_best_isolated_island": round(committed / min(isolated), 4),
        "committed_vs_median_isolated_island": round(committed / statistics.median(isolated), 4),
        "committed_vs_single_island_same_budget": round(committed / single[0], 4),
        "islands_agreeing_on_the_winner": sum(1 for c in consensus if c <= committed * (1 + 1e-9)),
        "seconds": {
            "consensus": round(t_consensus, 1),
            "isolated": round(t_isolated, 1),
            "single": round(t_single, 1),
        },
    }


@click.command()
@click.option(
    "--peers", "peers_text", default="4,8,16", show_default=True, help="Swarm sizes for the latency run."
)
@click.option(
    "--devices", "devices_text", default="32,64", show_default=True, help="Cluster sizes for the quality run."
)
@click.option(
    "--islands",
    type=click.IntRange(min=2),
    default=6,
    show_default=True,
    help="Islands (peers) in the quality run.",
)
@click.option(
    "--generations", type=click.IntRange(min=1), default=8, show_default=True, help="Generations per island."
)
@click.option(
    "--migrate-every",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Generations between migrations.",
)
@click.option(
    "--skew",
    type=float,
    default=1.0,
    show_default=True,
    help="planning.max_skew_s of the latency job (windows = 10/3 of it).",
)
@click.option(
    "--budget", type=float, default=5.0, show_default=True, help="planning.time_budget_s of the latency job."
)
@click.option(
    "--timeout",
    type=float,
    default=240.0,
    show_default=True,
    help="Seconds per swarm size for membership and commit.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--skip-swarm", is_flag=True, help="Only the in-process quality run.")
@click.option("--skip-quality", is_flag=True, help="Only the latency run on daemons.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the JSON here.")
def command(
    peers_text: str,
    devices_text: str,
    islands: int,
    generations: int,
    migrate_every: int,
    skew: float,
    budget: float,
    timeout: float,
    seed: int,
    skip_swarm: bool,
    skip_quality: bool,
    out: str | None,
) -> None:
    """Planning consensus: roster-close-to-commit latency on N daemons, and the winner's cost vs islands."""
    result: dict[str, Any] = {"benchmark": "consensus"}
    if not skip_quality:
        result["quality"] = [
            _quality(n, islands, generations, migrate_every, seed) for n in _ints(devices_text)
        ]
    if not skip_swarm:
        with tempfile.TemporaryDirectory(prefix="peerd-bench-consensus-") as tmp:
            result["latency"] = [_latency(n, Path(tmp), skew, budget, timeout) for n in _ints(peers_text)]
    emit_json(result, out)
