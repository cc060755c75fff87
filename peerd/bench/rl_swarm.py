"""``peerd bench rl-swarm``: a GRPO job (``kind: rl``) on N local daemons, end to end, with issue 13's figures.

One command starts ``--peers`` daemons on loopback (CPU, one torch thread each), submits a GRPO
job through peer 0's control socket and follows it (``job_status`` polls) until it is done:

- ``curve``: per iteration, the reward mean and pass rate of the completions trained on (the
  trainer's progress record), with the KL to the reference, the response length and the
  daemon's rollouts/s as the polls saw them (an iteration between two polls has none);
- ``heldout``: the policy at the start (after the warm-up) and at the end on a fixed held-out
  problem set (``task.problems(n, seed + 1_000_003)``, a stream apart from the job's problems;
  1-digit addition has only 100 distinct problems, so for it the set is a separate draw, not
  disjoint content). The end policy is the trainer's last checkpoint (``fetch`` over p2p ->
  ``model.pt``); the start is the spec's deterministic warm-up re-run here on one thread
  (``Learner(plan).warm_up()``, what the trainer ran). Target: ``min(3 x start, 0.6)``, met only
  if the end also beats the start; the largest KL seen;
- ``compare_async`` (``--compare-async K``): the same job with staleness 0 and K on the same
  swarm, rollouts/s of each (completions trained / seconds between the first and the last
  iteration seen) and the ratio async / sync, with each arm's allocation (the same peers) and
  staleness histogram (every completion within k). ``--link-mbps X --link-delay-ms Y`` shape every
  link between two daemons to X Mbit/s and Y ms one way (a scenario file the daemons load, as
  ``peerd bench wan`` does: ``peerd.swarm.shaper``), so the trainer -> rollout weight sync and the
  shard pushes take real time; its ``regime`` gives the per-iteration compute (replayed on one
  thread), the weights blob, the modelled transfer and what the sync iteration spent beyond
  compute. Async overlaps the rollout peers' fetch + sampling + push (R) with the trainer's update
  (T): sync pays R + T per iteration, k >= 1 about max(R, T), so the gain is largest when the link
  time makes R comparable to T and falls back toward 1 when either dominates alone.
  ``--compare-only`` runs just the two arms (no main job, held-out evaluation or prediction);
- ``prediction``: the RL cost model (``RLRosterScorer``) on the committed allocation and a roster
  rebuilt from the owner's status view right before the submission (each peer's measured fp32
  TFLOPS, free memory and links, as the consensus planned with them;
  memory bandwidth and seconds per op from the shared profile cache the daemons read), against the
  measured iteration time (the trainer's own: completions / its rollouts/s, median over
  iterations); per task against the swarm's own phases (``per_task_swarm``: the trainer's
  published medians, ``generate`` as the rollout peers timed their sampling, ``sync`` the rest of
  the trainer's wait for shards, against the predicted weight sync + transfers) and against the
  phases timed here by replaying the job's code on one thread (``per_task``: a shard's sampling =
  ``generate``, the reference log-probs, the actor's updates), with the relative errors;
  ``regime``: cores, load average at start and end, threads.

``--png`` plots the curve (reward, pass rate, held-out start/end and the target; KL and length).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click
import msgspec
import yaml
from click.core import ParameterSource

from peerd.bench import emit_json
from peerd.bench.rl_swarm_report import (
    async_ratio,
    colocated_report,
    curve_points,
    gradient_report,
    heldout_summary,
    kill_report,
    placement_arms,
    predict,
    prediction_report,
    throughput,
    write_plot,
)
from peerd.bench.rosters import committed_roster, daemon_profile, one_thread, probed_links
from peerd.errors import ErrorCode, PeerdError
from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.report import score
from peerd.jobs.rl.shards import RLPlan, sample_shard, shard_ranges
from peerd.jobs.service import roster_profile
from peerd.jobs.spec import parse_job_spec
from peerd.localswarm import LocalSwarm, converged
from peerd.models import load_checkpoint
from peerd.models.gpt import GPT
from peerd.rl.tasks import TASKS, TaskConfig, make_task
from peerd.rl.trainer import evaluate
from peerd.rl.weights import pack_weights
from peerd.swarm.links import ProbeConfig

HELDOUT_SEED_OFFSET = 1_000_003  # as peerd bench grpo: a problem stream apart from the job's
POLL_S = 0.25
REPLAY_ITERATIONS = 3

PROBE_INTERVAL_S = 4.0
SWARM_OPTIONS = {
    "record_ttl": 10.0,
    "refresh_interval": 2.0,
    "probe_interval": PROBE_INTERVAL_S,
    "probe_budget": 5,
    "startup_timeout": 60.0,
    "shutdown_timeout": 10.0,
    "device": "cpu",
}


LINK_SETTLE_S = (ProbeConfig().history + 1) * PROBE_INTERVAL_S
"""How long the bench waits once every daemon has measured the others. Those first figures come from
one probe each, taken while the swarm was forming: on loopback some links showed 3-9 ms round trips
that settle at 0.3-0.5 ms over the next rounds. After ``history`` more rounds every link's figures
are medians (``peerd.swarm.links``), and the consensus plans on those."""


@dataclass(frozen=True)
class Settings:
    """What the bench runs (the command line's values); defaults met the target on 4 CPU daemons."""

    peers: int = 4
    """Daemons on loopback: the trainers and rollout peers among them, as the consensus places them."""
    task: str = "addition"
    """The verifiable task (``peerd.rl.tasks``)."""
    min_size: int = 1
    """Smallest operand digits / string length."""
    max_size: int = 1
    """Largest operand digits / string length."""
    iterations: int = 300
    """GRPO iterations of the main job."""
    staleness: int = 0
    """Async bound k of the main job (0: synchronous)."""
    warmup_steps: int = 150
    """Supervised warm-up steps the trainer runs first (batch 64, lr 3e-3, as ``peerd bench grpo``)."""
    group_size: int = 8
    """Completions per prompt (G)."""
    prompts: int = 16
    """Prompts per iteration (two optimizer updates per iteration when even)."""
    lr: float = 1e-3
    """GRPO learning rate (AdamW, constant)."""
    kl_coef: float = 0.04
    """Weight of the k3 KL penalty to the reference."""
    d_model: int = 32
    """Width of the 2-layer GPT (``tiny`` preset, overridden)."""
    eval_problems: int = 256
    """Held-out problems evaluated at the start and the end."""
    seed: int = 0
    """Model seed; the warm-up uses seed + 1, the held-out set seed + 1_000_003."""
    compare_async: int | None = None
    """Also run the job at staleness 0 and this k on the same swarm (None: no comparison)."""
    compare_iterations: int = 100
    """Iterations of each comparison job."""
    job_timeout_s: float = 900.0
    """Seconds one job may take before it is cancelled and the bench fails."""
    link_mbps: float | None = None
    """Shape every link between two daemons to this many Mbit/s (None: loopback, unshaped)."""
    link_delay_ms: float = 0.0
    """One-way delay of every shaped link, ms (with ``link_mbps``)."""
    compare_only: bool = False
    """Run only the ``compare_async`` arms: no main job, held-out evaluation or prediction."""
    compare_colocated: bool = False
    """Also run the verl-like colocated plan on the same peers (``parallel.d_dp`` = peers: every peer
    samples its share, computes the reference and trains, averaging each update's gradients)."""
    init_checkpoint: str | None = None
    """Every job's policy starts from this ``peerd fetch`` output of the same model (None: the seed),
    then warms up (``--warmup-steps``)."""
    compare_gradient_bits: int | None = None
    """Also run the sync job with two data-parallel trainers twice on the same peers, averaging their
    gradients in fp32 and at this many bits (``compression.gradient_bits``): measured and predicted
    iteration, ratio, averaging bytes (None: no comparison)."""
    min_rollout_peers: int = 1
    """``rl.min_rollout_peers`` of the consensus-placed jobs: the consensus keeps at least this many rollout
    peers (0: it may choose a lone trainer that samples every prompt itself, as it does on one
    machine's shared cores; the async comparison needs rollout peers)."""
    kill_rollout_at: int | None = None
    """SIGKILL one rollout peer of the main job (not the owner, whose control socket the bench
    polls) once it has trained this many iterations; the report's ``kill`` section says what the job
    lost and how its pass rate went on (None: no kill)."""


def job_spec(
    s: Settings,
    *,
    staleness: int,
    iterations: int,
    name: str,
    trainers: int | None = None,
    gradient_bits: int | None = None,
) -> dict[str, Any]:
    """The GRPO job the swarm runs: a 2-layer GPT of width ``d_model``, ``prompts x group_size``
    completions; ``trainers``: that many data-parallel trainers (None: ``auto``, the consensus chooses),
    averaging at ``gradient_bits`` (None: fp32)."""
    task = make_task(TaskConfig(name=s.task, min_size=s.min_size, max_size=s.max_size))
    batch = s.prompts * s.group_size
    spec = {
        "name": name,
        "kind": "rl",
        "model": {"preset": "tiny", "overrides": {"d_model": s.d_model}, "seed": s.seed},
        "steps": iterations,
        "global_batch": batch,
        "micro_batch": batch // 2 if s.prompts % 2 == 0 else batch,  # two updates per iteration
        "optimizer": {"name": "adamw", "lr": s.lr, "schedule": "constant", "grad_clip": 1.0},
        "checkpoint_interval": iterations,
        # a job must re-plan on the peers a kill leaves: at min_peers = peers it would wait for a newcomer
        "min_peers": s.peers if s.kill_rollout_at is None else 2,
        "max_peers": s.peers,
        "planning": {"time_budget_s": 2, "max_skew_s": 1.0},
        "rl": {
            "task": {"name": s.task, "min_size": s.min_size, "max_size": s.max_size},
            "group_size": s.group_size,
            "staleness": staleness,
            "sampling": {"max_new_tokens": task.max_answer_len + 1, "temperature": 1.0},
            "loss": {"kl_coef": s.kl_coef},
            "warmup": {"steps": s.warmup_steps, "batch_size": 64, "lr": 3e-3, "seed": s.seed + 1},
            "rollout_timeout_s": 120,
            # every peer a trainer leaves none to roll out
            "min_rollout_peers": s.min_rollout_peers if trainers is None or trainers < s.peers else 0,
        },
    }
    if trainers is not None:
        spec["parallel"] = {"d_pp": 1, "d_dp": trainers}
    if gradient_bits is not None:
        spec["compression"] = {"gradient_bits": gradient_bits}
    if s.init_checkpoint is not None:
        spec["init_checkpoint"] = s.init_checkpoint
    parse_job_spec(spec)  # fail before any daemon starts if it is not a valid job
    return spec


# -- the swarm -------------------------------------------------------------------------------------


def link_scenario(names: list[str], mbps: float, delay_ms: float) -> dict[str, Any]:
    """A shaping scenario (``peerd.sched.scenario``) with every daemon its own site: ``mbps`` and
    ``delay_ms`` one way between any two, unshaped within a site."""
    n = len(names)
    return {
        "name": f"rl-swarm-{n}peers-{mbps:g}mbit-{delay_ms:g}ms",
        "description": f"{n} loopback daemons, each its own site, {mbps:g} Mbit/s and {delay_ms:g} ms one way "
        "between any two (peerd bench rl-swarm)",
        "regions": {
            "names": [f"site-{n}" for n in names],
            "delay_ms": [[0.0 if i == j else float(delay_ms) for j in range(n)] for i in range(n)],
            "bandwidth_mbps": [[10000.0 if i == j else float(mbps) for j in range(n)] for i in range(n)],
        },
        "devices": [{"id": name, "region": f"site-{name}"} for name in names],
    }


def start_swarm(s: Settings, root: Path, cache: Path) -> LocalSwarm:
    """``s.peers`` daemons on loopback reading one profile cache, shaped by ``link_scenario`` with ``s.link_mbps``."""
    names = [f"peer{i}" for i in range(s.peers)]
    options: dict[str, Any] = {**SWARM_OPTIONS, "profile_cache": str(cache)}
    if s.link_mbps is not None:
        scenario = root / "links.yaml"
        scenario.write_text(
            yaml.safe_dump(link_scenario(names, s.link_mbps, s.link_delay_ms), sort_keys=False)
        )
        options["scenario"] = str(scenario)
    swarm = LocalSwarm(s.peers, root / "s", options=options, names=names, ready_timeout=180)
    click.echo(f"starting {s.peers} daemons", err=True)
    swarm.start()
    try:
        swarm.wait_until(
            lambda v: converged(v, names), timeout=180, what="every daemon to measure the others"
        )
        time.sleep(LINK_SETTLE_S)
    except BaseException:
        swarm.close()
        raise
    return swarm


@dataclass
class Followed:
    """What following one job through its owner's control socket saw."""

    job_id: str
    view: dict[str, Any]
    wall_s: float
    seen: list[tuple[float, int]]  # (seconds since submit, iterations done), one per new iteration
    polled: dict[int, dict[str, float]]  # iteration -> kl, response_len, rollouts_per_s seen with it
    status: dict[str, Any]
    """The owner's status right before the submission: the peers and links its consensus planned with."""
    killed: dict[str, Any] | None = None
    """The rollout peer killed mid-job (``Settings.kill_rollout_at``): name, peer id, iteration, seconds."""


def kill_a_rollout_peer(
    swarm: LocalSwarm, view: dict[str, Any], iteration: int, at_s: float
) -> dict[str, Any]:
    """SIGKILL a rollout peer of the job ``view`` shows, other than the owner (peer 0, which the bench
    polls); PeerdError when it has none."""
    spares = set((view.get("allocation") or {}).get("spares") or [])
    victims = [
        (p, p.info.peer_id) for p in swarm.peers[1:] if p.info is not None and p.info.peer_id in spares
    ]
    if not victims:
        raise PeerdError("no rollout peer besides the owner to kill: raise --min-rollout-peers")
    victim, peer_id = victims[0]
    swarm.kill_peer(victim)
    click.echo(f"  killed rollout peer {victim.name} after iteration {iteration}", err=True)
    return {
        "peer": victim.name,
        "peer_id": peer_id,
        "at_iteration": iteration,
        "at_s": round(at_s, 2),
        "epoch": (view.get("churn") or {}).get("epoch"),
    }


def follow(
    swarm: LocalSwarm, spec: dict[str, Any], timeout: float, kill_rollout_at: int | None = None
) -> Followed:
    """Submit ``spec`` through peer 0 and poll ``job_status`` until the job is done; PeerdError when it
    ends otherwise (failed, cancelled) or takes longer than ``timeout`` (then it is cancelled).
    ``kill_rollout_at``: SIGKILL a rollout peer once that many iterations are trained."""
    owner = swarm.peers[0]
    # the links as the consensus sees them: a probe taken while an earlier job loaded a shaped link
    # measured what that job left of it, and its prediction should price what the peers planned with
    status = owner.status()
    submitted = time.monotonic()
    job = owner.control().call("submit", spec=spec)["job_id"]
    seen: list[tuple[float, int]] = []
    polled: dict[int, dict[str, float]] = {}
    view: dict[str, Any] = {}
    killed: dict[str, Any] | None = None
    while True:
        with contextlib.suppress(PeerdError):
            view = owner.control().call("job_status", job_id=job)
            rl = (view.get("progress") or {}).get("rl") or {}
            it = int(rl.get("iteration") or 0)
            if it > 0 and (not seen or it > seen[-1][1]):
                seen.append((time.monotonic() - submitted, it))
                keys = ("kl", "response_len", "rollouts_per_s", "reward_mean", "pass_rate")
                polled[it] = {k: float(rl[k]) for k in keys if rl.get(k) is not None}
                click.echo(
                    f"  {spec['name']}: iteration {it}/{spec['steps']} pass {rl.get('pass_rate')} "
                    f"kl {rl.get('kl'):.4f}",
                    err=True,
                )
                if kill_rollout_at is not None and killed is None and it >= kill_rollout_at:
                    killed = kill_a_rollout_peer(swarm, view, it, time.monotonic() - submitted)
            if view.get("state") in ("done", "failed", "cancelled"):
                break
        if time.monotonic() - submitted > timeout:
            with contextlib.suppress(PeerdError):
                owner.control().call("cancel", job_id=job)
            raise PeerdError(
                f"job {spec['name']} did not finish within {timeout:.0f} s (state {view.get('state')})",
                code=ErrorCode.TIMEOUT,
            )
        time.sleep(POLL_S)
    if view.get("state") != "done":
        raise PeerdError(f"job {spec['name']} ended {view.get('state')}: {view.get('reason')}")
    return Followed(job, view, time.monotonic() - submitted, seen, polled, status, killed)


# -- in-process parts (one thread) ---------------------------------------------------------------


def assess(model: GPT, plan: RLPlan, s: Settings) -> dict[str, float]:
    held_out = plan.task.problems(s.eval_problems, seed=s.seed + HELDOUT_SEED_OFFSET)
    return asdict(evaluate(model, plan.task, held_out, s.group_size, plan.rl.sampling, s.seed))


def start_and_phases(
    plan: RLPlan, s: Settings, rollout_peers: int, *, evaluate_start: bool = True
) -> tuple[dict[str, float], dict[str, Any]]:
    """The warmed-up policy's held-out figures, then the phases of ``REPLAY_ITERATIONS`` sync iterations.

    ``generate`` is the slowest shard's sampling (the rollout peers sample in parallel), the
    rest as the trainer runs them: scoring, reference log-probs, the actor's updates.
    """
    with one_thread():
        learner = Learner(plan)
        learner.warm_up()
        start = assess(learner.policy, plan, s) if evaluate_start else {}
        rows: list[dict[str, float]] = []
        for t in range(REPLAY_ITERATIONS):
            shard_s, groups = [], []
            for k, indices in enumerate(shard_ranges(plan.prompts, rollout_peers)):
                began = time.perf_counter()
                groups += sample_shard(learner.policy, plan, t, k, indices, learner.version)
                shard_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            score(plan.task, groups)
            scored = time.perf_counter() - began
            figures = learner.train(groups)
            rows.append(
                {
                    "generate": max(shard_s),
                    "score": scored,
                    "reference": figures.reference_s,
                    "actor_train": figures.train_s,
                }
            )
    phases = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return start, {"iterations": REPLAY_ITERATIONS, "rollout_shards": rollout_peers, "median_s": phases}


def end_policy(swarm: LocalSwarm, job: str, out: Path) -> tuple[GPT, dict[str, Any]]:
    """The trainer's last checkpoint, fetched over p2p through peer 0 and loaded from ``model.pt``."""
    fetched = swarm.peers[0].control(timeout=120).call("fetch", job_id=job, out=str(out))
    model = load_checkpoint(fetched["path"])
    assert isinstance(model, GPT), "rl jobs train the built-in GPT"
    return model, {"step": fetched["step"], "parameters": fetched["parameters"]}


# -- the whole bench -------------------------------------------------------------------------------


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def measured_iteration_s(f: Followed, per_iteration: int) -> float | None:
    """Median of the trainer's own iteration times (completions / its rollouts/s) the polls saw."""
    rates = [p["rollouts_per_s"] for p in f.polled.values() if p.get("rollouts_per_s")]
    return statistics.median(per_iteration / r for r in rates) if rates else None


def arm(f: Followed, per_iteration: int, ids: dict[str, str] | None = None) -> dict[str, Any]:
    rl = (f.view.get("progress") or {}).get("rl") or {}
    alloc = f.view.get("allocation") or {}
    name = (ids or {}).get
    rate = throughput(f.seen, per_iteration)
    return {
        "job_id": f.job_id,
        "state": f.view.get("state"),
        "trainer": sorted(name(p, p) for st in alloc.get("stages") or [] for p in st),
        "rollout_peers": sorted(name(p, p) for p in alloc.get("spares") or []),
        "iterations_seen": len(f.seen),
        "wall_s": round(f.wall_s, 2),
        # seconds from submit to the first and the last iteration the polls saw (planning and warm-up come first)
        "seen_s": [round(f.seen[0][0], 2), round(f.seen[-1][0], 2)] if f.seen else None,
        "rollouts_per_s": rate,
        "iteration_s": per_iteration / rate if rate else None,
        # the trainer's own clock: completions over the periods of its iterations after the first
        "rollouts_per_s_trainer": rl.get("steady_rollouts_per_s"),
        "rollouts_per_s_daemon_median": statistics.median(p["rollouts_per_s"] for p in f.polled.values())
        if f.polled
        else None,
        "staleness": rl.get("staleness"),
        "completions_trained": sum(n for _, n in rl.get("staleness") or []),
        "weight_sync_bytes": rl.get("weight_sync_bytes"),
        "replans": len((f.view.get("planning") or {}).get("replans") or []),
        "dropped_stale": rl.get("dropped_stale"),
        "dropped_late": rl.get("dropped_late"),
        "shards_missing": rl.get("shards_missing"),
    }


def compare_arms(swarm: LocalSwarm, s: Settings, main: Followed | None = None) -> dict[str, Any]:
    """The job at staleness 0 and ``s.compare_async`` on ``swarm``, one after the other (sync first);
    ``main`` stands for the arm it equals (same staleness and iterations)."""
    assert s.compare_async is not None
    per_iteration = s.prompts * s.group_size
    status = swarm.peers[0].status()
    ids = {p["peer_id"]: p["name"] for p in status.get("peers", [])}
    arms: dict[str, Any] = {}
    for k in sorted({0, s.compare_async}):
        name = f"rl-swarm-staleness{k}"
        if main is not None and k == s.staleness and s.compare_iterations == s.iterations:
            arms[name] = arm(main, per_iteration, ids)
            continue
        click.echo(f"comparing: staleness {k}, {s.compare_iterations} iterations", err=True)
        arm_spec = job_spec(s, staleness=k, iterations=s.compare_iterations, name=name)
        arms[name] = arm(follow(swarm, arm_spec, s.job_timeout_s), per_iteration, ids)
    return arms


DP_TRAINERS = 2  # the gradient comparison's trainers: the ring and the runtime's exchange agree at two


def placement_spec(s: Settings, arm: str) -> dict[str, Any]:
    """The sync job of comparison arm ``arm``: ``consensus`` (as the peers place it), ``colocated``
    (every peer a trainer), ``dp-fp32`` and ``dp-q<bits>`` (two data-parallel trainers averaging in
    fp32 or at ``compare_gradient_bits``)."""
    trainers = {"consensus": None, "colocated": s.peers}.get(arm, DP_TRAINERS)
    bits = s.compare_gradient_bits if arm.startswith("dp-q") else None
    return job_spec(
        s,
        staleness=0,
        iterations=s.compare_iterations,
        name=f"rl-swarm-{arm}",
        trainers=trainers,
        gradient_bits=bits,
    )


def gradient_arm_names(s: Settings) -> list[str]:
    """The ``compare_gradient_bits`` arms: the same two trainers in fp32, then compressed."""
    return ["dp-fp32", f"dp-q{s.compare_gradient_bits}"]


def gradient_arms(swarm: LocalSwarm, s: Settings) -> dict[str, Followed]:
    """The two-trainer sync job averaging in fp32 and at ``compare_gradient_bits``, one after the other."""
    arms = {}
    for name in gradient_arm_names(s):
        click.echo(f"gradient comparison: {name}, {s.compare_iterations} iterations", err=True)
        arms[name] = follow(swarm, placement_spec(s, name), s.job_timeout_s)
    return arms


def colocated_arms(swarm: LocalSwarm, s: Settings, main: Followed) -> dict[str, Followed]:
    """The consensus plan and the verl-like colocated plan (every peer a trainer) of the same sync job
    on ``swarm``; ``main`` stands for the consensus arm when it is that job."""
    arms = {}
    if s.staleness == 0 and s.compare_iterations == s.iterations:
        arms["consensus"] = main
    else:
        click.echo(f"colocated comparison: the consensus plan, {s.compare_iterations} iterations", err=True)
        arms["consensus"] = follow(swarm, placement_spec(s, "consensus"), s.job_timeout_s)
    click.echo(f"colocated comparison: {s.peers} trainers, {s.compare_iterations} iterations", err=True)
    arms["colocated"] = follow(swarm, placement_spec(s, "colocated"), s.job_timeout_s)
    return arms


def weights_bytes(plan: RLPlan) -> int:
    """Bytes of one packed weights blob a rollout peer fetches per version (the trainer's format)."""
    learner = Learner(plan)
    return len(pack_weights(0, learner.weights()))


def comparison_report(
    s: Settings, arms: dict[str, Any], phases: dict[str, Any], plan: RLPlan, cores: int
) -> dict[str, Any]:
    """``compare_async``: the arms, their ratio, and the regime they ran in (compute vs link per iteration)."""
    assert s.compare_async is not None
    sync, lagged = arms.get("rl-swarm-staleness0"), arms.get(f"rl-swarm-staleness{s.compare_async}")
    compute = dict(phases["median_s"])
    trainer_s = sum(v for k, v in compute.items() if k != "generate")
    blob = weights_bytes(plan)
    link: dict[str, Any] = {"shaped": s.link_mbps is not None}
    if s.link_mbps is not None:
        delay = s.link_delay_ms / 1000
        weights_s = blob * 8 / (s.link_mbps * 1e6)
        link.update(
            mbps=s.link_mbps,
            delay_ms=s.link_delay_ms,
            topology="every daemon its own site; the same link between any two (a scenario file, "
            "peerd.swarm.shaper paces each daemon's outgoing bytes)",
            weights_s=weights_s,
            # the sync critical path crosses a link 4 times: poll answered, fetch asked, weights back, shard pushed
            transfer_s_modelled=weights_s + 4 * delay,
        )
    sync_s = (sync or {}).get("iteration_s")
    rollout_s = compute["generate"] + link.get("transfer_s_modelled", 0.0)
    regime = {
        "compute_s_per_iteration": {
            **compute,
            "trainer": trainer_s,
            "source": f"replayed here on one thread ({phases['iterations']} sync iterations, "
            f"{phases['rollout_shards']} shards; generate is the slowest shard)",
        },
        "weights_blob_bytes": blob,
        "link": link,
        "rollout_side_s_modelled": rollout_s,
        "sync_iteration_s": sync_s,
        "sync_beyond_compute_s": sync_s - compute["generate"] - trainer_s if sync_s else None,
        "async_iteration_s": (lagged or {}).get("iteration_s"),
        "overlap_bound": (rollout_s + trainer_s) / max(rollout_s, trainer_s),
        "overlap_bound_note": "sync pays R + T per iteration, k >= 1 about max(R, T) (R: a rollout peer's "
        "fetch + sampling + push, modelled; T: the trainer's scoring, reference and updates)",
        "cores": cores,
        "daemons": s.peers,
        "load_average": load_average(),
    }

    def members(a: dict[str, Any] | None, roles: tuple[str, ...]) -> list[str] | None:
        return sorted(p for r in roles for p in a[r]) if a else None

    both = ("trainer", "rollout_peers")
    return {
        "staleness": s.compare_async,
        "arms": arms,
        # every link is the same, so the arms differ only by staleness when they run on the same peers
        # (the consensus plans each job afresh: which of them trains may differ)
        "same_peers": members(sync, both) is not None and members(sync, both) == members(lagged, both),
        "same_roles": members(sync, ("trainer",)) is not None
        and members(sync, ("trainer",)) == members(lagged, ("trainer",)),
        "regime": regime,
        **async_ratio(sync, lagged),
    }


def async_comparison(s: Settings) -> dict[str, Any]:
    """``--compare-only``: start the (shaped) swarm, run the two arms, replay the compute; the ``compare_async`` section."""
    assert s.compare_async is not None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="peerd-rl-swarm-") as tmp:
        root = Path(tmp)
        cache = root / "device_profiles.json"
        daemon_profile(cache)
        swarm = start_swarm(s, root, cache)
        try:
            arms = compare_arms(swarm, s)
        finally:
            swarm.close()
    plan = RLPlan(
        "compare", parse_job_spec(job_spec(s, staleness=0, iterations=s.compare_iterations, name="c"))
    )
    rollout_peers = len((arms.get("rl-swarm-staleness0") or {}).get("rollout_peers") or []) or s.peers - 1
    _, phases = start_and_phases(plan, s, rollout_peers, evaluate_start=False)
    return comparison_report(s, arms, phases, plan, cores)


def rl_swarm(s: Settings, png: str | None = None) -> dict[str, Any]:
    started, load_start = time.monotonic(), load_average()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    spec = job_spec(s, staleness=s.staleness, iterations=s.iterations, name="rl-swarm")
    per_iteration = spec["global_batch"]
    with tempfile.TemporaryDirectory(prefix="peerd-rl-swarm-") as tmp:
        root = Path(tmp)
        cache = root / "device_profiles.json"
        profile = daemon_profile(cache)
        assert profile.memory_gb_s is not None
        swarm = start_swarm(s, root, cache)
        try:
            click.echo(f"submitting {s.iterations} iterations of GRPO on {s.task}", err=True)
            main = follow(swarm, spec, s.job_timeout_s, s.kill_rollout_at)
            alloc = main.view["allocation"]
            status = main.status
            model, fetched = end_policy(swarm, main.job_id, root / "fetched")
            arms = compare_arms(swarm, s, main) if s.compare_async is not None else {}
            placements = colocated_arms(swarm, s, main) if s.compare_colocated else {}
            compressed = gradient_arms(swarm, s) if s.compare_gradient_bits is not None else {}
        finally:
            swarm.close()
    job = parse_job_spec(spec)
    plan = RLPlan(main.job_id, job)
    click.echo("evaluating the start (warm-up re-run) and the fetched end policy", err=True)
    # a lone trainer samples its prompts as one shard
    start, phases = start_and_phases(plan, s, max(1, len(alloc["spares"])))
    with one_thread():
        end = assess(model, plan, s)
    measured = roster_profile(profile, "")
    predicted = predict(job, committed_roster(status, alloc, measured), alloc)
    ids = {p["peer_id"]: p["name"] for p in status.get("peers", [])}
    final_rl = main.view["progress"]["rl"]
    kl_max = final_rl.get("kl_max")  # the trainer's running maximum over every iteration
    iteration_s = measured_iteration_s(main, per_iteration)
    curve = curve_points(final_rl.get("rewards") or [], main.polled)
    out: dict[str, Any] = {
        "benchmark": "rl-swarm",
        "settings": asdict(s),
        "job": {
            k: spec[k]
            for k in ("model", "steps", "global_batch", "micro_batch", "optimizer", "rl", "init_checkpoint")
            if k in spec
        },
        "regime": {
            "device": "cpu",
            "cores": cores,
            "daemons": s.peers,
            "torch_threads_per_daemon": 1,
            "load_average_start": load_start,
            "load_average_end": load_average(),
            "profile": {
                "fp32_tflops": profile.tflops.get("fp32"),
                "memory_gb_s": profile.memory_gb_s,
                "launch_us": profile.launch_us,
                "element_ns": msgspec.structs.asdict(profile.element_ns) if profile.element_ns else None,
                "message_us": profile.message_us,
                "wire_byte_ns": profile.wire_byte_ns,
            },
            "links": probed_links(status, alloc),
            "note": f"{s.peers} daemons share {cores} cores with whatever else runs on the machine",
        },
        "allocation": {
            "trainer": [ids.get(p, p) for st in alloc["stages"] for p in st],
            "rollout_peers": [ids.get(p, p) for p in alloc["spares"]],
            "committed_cost_s": alloc.get("cost"),
        },
        "job_id": main.job_id,
        "wall_s": round(main.wall_s, 2),
        "curve": curve,
        "rl_final": {k: v for k, v in final_rl.items() if k != "rewards"},
        # a re-plan mid-job (e.g. a trainer's heartbeat late under load) restarts the trainer's record
        "replans": (main.view.get("planning") or {}).get("replans") or [],
        "churn": main.view.get("churn") or {},
        "kill": kill_report(main.killed, curve, main.view, per_iteration, main.seen) if main.killed else None,
        "heldout": {
            **heldout_summary(start, end, [kl_max] if kl_max is not None else []),
            "kl_max_over": "every iteration (the trainer's record)",
            "problems": s.eval_problems,
            "seed": s.seed + HELDOUT_SEED_OFFSET,
            "samples_per_problem": s.group_size,
            "start_source": "the spec's warm-up re-run in this process on one thread (deterministic)",
            "end_source": {"fetched": fetched},
        },
        "prediction": prediction_report(
            predicted, phases, iteration_s, alloc.get("cost"), final_rl.get("phases_s")
        ),
        "measured_iteration_s_polls": per_iteration / rate
        if (rate := throughput(main.seen, per_iteration))
        else None,
        "seconds": round(time.monotonic() - started, 1),
    }
    if s.compare_async is not None:
        out["compare_async"] = comparison_report(s, arms, phases, plan, cores)

    def arms_of(followed: dict[str, Followed]) -> dict[str, dict[str, Any]]:
        specs = {name: parse_job_spec(placement_spec(s, name)) for name in followed}
        views = {name: f.view for name, f in followed.items()}
        statuses = {name: f.status for name, f in followed.items()}
        return placement_arms(views, statuses, specs, measured)

    if placements:
        out["compare_colocated"] = colocated_report(arms_of(placements))
    if compressed:
        fp32_name, quantized_name = gradient_arm_names(s)
        quantized = parse_job_spec(placement_spec(s, quantized_name))
        # the compressed job priced on the fp32 arm's roster and roles: the model's ratio from the
        # compression alone (each arm's own prediction also holds its own probes of the links)
        base = compressed[fp32_name]
        roster = committed_roster(base.status, base.view["allocation"], measured)
        same = predict(quantized, roster, base.view["allocation"])["seconds"]
        out["compare_gradient_bits"] = gradient_report(arms_of(compressed), quantized, s.link_mbps, same)
    if png:
        out["png"] = write_plot(out, Path(png))
    return out


QUICK: dict[str, Any] = {
    "peers": 3,
    "iterations": 60,
    "compare_iterations": 60,
    "eval_problems": 128,
}


@click.command("rl-swarm")
@click.option(
    "--peers",
    default=4,
    show_default=True,
    help="Daemons (the consensus chooses the trainers and the rollout peers among them).",
)
@click.option("--task", "task_name", type=click.Choice(sorted(TASKS)), default="addition", show_default=True)
@click.option("--min-size", default=1, show_default=True, help="Smallest operand digits / string length.")
@click.option("--max-size", default=1, show_default=True, help="Largest operand digits / string length.")
@click.option("--iterations", default=Settings.iterations, show_default=True, help="GRPO iterations.")
@click.option("--staleness", default=0, show_default=True, help="Async bound k of the main job (0 = sync).")
@click.option(
    "--warmup-steps", default=Settings.warmup_steps, show_default=True, help="Supervised warm-up steps."
)
@click.option("--group-size", default=8, show_default=True, help="Completions per prompt (G).")
@click.option("--prompts", default=16, show_default=True, help="Prompts per iteration.")
@click.option("--lr", default=Settings.lr, show_default=True, help="GRPO learning rate (AdamW).")
@click.option("--kl-coef", default=Settings.kl_coef, show_default=True, help="Weight of the k3 KL penalty.")
@click.option("--d-model", default=Settings.d_model, show_default=True, help="Width of the 2-layer GPT.")
@click.option("--eval-problems", default=256, show_default=True, help="Held-out problems for start/end.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--compare-async", type=int, default=None, help="Also run staleness 0 and K: rollouts/s of each."
)
@click.option(
    "--compare-iterations",
    default=Settings.compare_iterations,
    show_default=True,
    help="Iterations of each comparison job.",
)
@click.option(
    "--link-mbps",
    type=float,
    default=None,
    help="Shape every link between two daemons to this many Mbit/s (a scenario file; default: unshaped).",
)
@click.option(
    "--link-delay-ms", default=0.0, show_default=True, help="One-way delay of every shaped link (ms)."
)
@click.option(
    "--compare-only",
    is_flag=True,
    help="Only the --compare-async arms (no main job, held-out evaluation or prediction).",
)
@click.option(
    "--compare-colocated",
    is_flag=True,
    help="Also run the verl-like colocated plan (every peer a data-parallel trainer sampling its own "
    "share) and the consensus plan, --compare-iterations each: measured and predicted iteration, ratio.",
)
@click.option(
    "--init-checkpoint",
    type=click.Path(exists=True),
    default=None,
    help="Start every job's policy from this peerd fetch output of the same model (e.g. a pretraining "
    "job's), then warm up; default: the seeded init.",
)
@click.option(
    "--compare-gradient-bits",
    type=click.Choice(["2", "3", "4", "8"]),
    default=None,
    help="Also run the job with two data-parallel trainers twice, averaging in fp32 and at these bits, "
    "--compare-iterations each: measured and predicted iteration, ratio (shape the links with --link-mbps "
    "to make it link-bound).",
)
@click.option(
    "--min-rollout-peers",
    default=1,
    show_default=True,
    type=click.IntRange(min=0),
    help="Rollout peers the consensus keeps at least in the jobs it places (0: it may choose a lone "
    "trainer sampling every prompt itself).",
)
@click.option(
    "--kill-rollout-at",
    type=click.IntRange(min=1),
    default=None,
    help="SIGKILL one rollout peer of the main job (not peer 0, the owner) after this many iterations; "
    "the JSON's kill section: the pass rate before and at the end, the re-plan, what was lost.",
)
@click.option("--job-timeout", default=900.0, show_default=True, help="Seconds one job may take.")
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke run: 3 peers, 60 iterations, 60 per comparison job, 128 held-out problems.",
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--png", default=None, type=click.Path(dir_okay=False), help="Write the curve plot here.")
def command(
    peers: int,
    task_name: str,
    min_size: int,
    max_size: int,
    iterations: int,
    staleness: int,
    warmup_steps: int,
    group_size: int,
    prompts: int,
    lr: float,
    kl_coef: float,
    d_model: int,
    eval_problems: int,
    seed: int,
    compare_async: int | None,
    compare_iterations: int,
    link_mbps: float | None,
    link_delay_ms: float,
    compare_only: bool,
    compare_colocated: bool,
    compare_gradient_bits: str | None,
    init_checkpoint: str | None,
    min_rollout_peers: int,
    kill_rollout_at: int | None,
    job_timeout: float,
    quick: bool,
    out: str | None,
    png: str | None,
) -> None:
    """A GRPO job on local daemons: curve, held-out pass rate start vs end, sync vs async, predicted vs measured (JSON)."""
    s = Settings(
        peers=peers,
        task=task_name,
        min_size=min_size,
        max_size=max_size,
        iterations=iterations,
        staleness=staleness,
        warmup_steps=warmup_steps,
        group_size=group_size,
        prompts=prompts,
        lr=lr,
        kl_coef=kl_coef,
        d_model=d_model,
        eval_problems=eval_problems,
        seed=seed,
        compare_async=compare_async,
        compare_iterations=compare_iterations,
        job_timeout_s=job_timeout,
        link_mbps=link_mbps,
        link_delay_ms=link_delay_ms,
        compare_only=compare_only,
        compare_colocated=compare_colocated,
        compare_gradient_bits=int(compare_gradient_bits) if compare_gradient_bits else None,
        init_checkpoint=str(Path(init_checkpoint).resolve()) if init_checkpoint else None,
        min_rollout_peers=min_rollout_peers,
        kill_rollout_at=kill_rollout_at,
    )
    if quick:  # smaller defaults; what the command line gives explicitly still counts
        ctx = click.get_current_context()
        given = {n for n in QUICK if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE}
        s = replace(s, **{k: v for k, v in QUICK.items() if k not in given})
    if s.peers < 2 or s.iterations < 2 or s.compare_iterations < 2:
        raise click.BadParameter("needs --peers >= 2, --iterations >= 2 and --compare-iterations >= 2")
    if s.min_rollout_peers > s.peers - 1:
        raise click.BadParameter(
            f"at most --peers - 1 = {s.peers - 1} beside the trainer", param_hint="--min-rollout-peers"
        )
    if s.kill_rollout_at is not None:
        if s.kill_rollout_at >= s.iterations:
            raise click.BadParameter(
                f"must be below --iterations ({s.iterations})", param_hint="--kill-rollout-at"
            )
        others = (s.compare_only, s.compare_colocated, s.compare_async, s.compare_gradient_bits)
        if any(o not in (None, False) for o in others):
            raise click.BadParameter(
                "the comparisons run on the swarm the main job leaves: not with a kill",
                param_hint="--kill-rollout-at",
            )
    if (s.link_mbps is not None and not s.link_mbps > 0) or s.link_delay_ms < 0:
        raise click.BadParameter("needs --link-mbps > 0 and --link-delay-ms >= 0")
    if s.compare_colocated:
        if s.compare_only:
            raise click.BadParameter("--compare-colocated runs beside the main job, not with --compare-only")
        try:  # every peer a trainer: each needs an equal share of every update
            placement_spec(s, "colocated")
        except PeerdError as exc:
            raise click.BadParameter(f"--compare-colocated with {s.peers} peers: {exc}") from exc
    if s.compare_gradient_bits is not None:
        if s.compare_only:
            raise click.BadParameter(
                "--compare-gradient-bits runs beside the main job, not with --compare-only"
            )
        try:  # two trainers: each needs an equal share of every update
            placement_spec(s, gradient_arm_names(s)[1])
        except PeerdError as exc:
            raise click.BadParameter(f"--compare-gradient-bits with {s.peers} peers: {exc}") from exc
    if s.compare_only:
        if s.compare_async is None:
            raise click.BadParameter("--compare-only needs --compare-async K")
        spec = job_spec(s, staleness=0, iterations=s.compare_iterations, name="rl-swarm")
        result: dict[str, Any] = {
            "benchmark": "rl-swarm",
            "settings": asdict(s),
            "job": {k: spec[k] for k in ("model", "global_batch", "micro_batch", "optimizer", "rl")},
            "compare_async": async_comparison(s),
        }
    else:
        result = rl_swarm(s, png)
    flags = {"compare_only", "compare_colocated"}
    result["command"] = "peerd bench rl-swarm " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if k in flags else f" {v}")
        for k, v in asdict(s).items()
        if v is not None and k != "job_timeout_s" and (k not in flags or v)
    )
    emit_json(result, out)
