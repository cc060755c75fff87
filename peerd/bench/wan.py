"""``peerd bench wan``: the same GPT job under four arms on a local swarm shaped like a geo-distributed one.

N ``peerd join`` daemons (8 by default) run on this machine; each shapes its outgoing
traffic (``peerd.swarm.shaper``) by a scenario of ``configs/scenarios/`` (world-wide by
default, DT-FM case 4; ``--scenario regional`` = case 3, ``multi-dc`` = case 2), its regions
mapped onto the peers in blocks (peer ``i`` in region ``i * R // N``). One job per arm is
submitted, planned by consensus and trained; the daemons' progress records give tokens/s
and the loss against wall-clock and against tokens:

- ``a-peerd``: the searched allocation, AC-SGD forward (4 bit), 8-bit backward, 8-bit gradients;
- ``b-peerd-fp32``: the searched allocation, nothing compressed;
- ``c-random-s<K>``: ``planning.placement: random`` (the Megatron-like default: ranks in a
  seeded random order, ``peerd.sched.placement``), nothing compressed, one run per seed;
- ``d-dp-only``: ``d_pp = 1``, the model replicated on every peer, 8-bit gradient averaging.

Arms a-c share one shape (``shape``: ``N / 2`` stages x 2 replicas up to 8 peers, 4 x 4 at 16),
so they differ only in placement and compression.

The regime (why the links are scaled, and by how much)
------------------------------------------------------
The papers' numbers are for GPT3-XL (24 layers, hidden 2048, seq 2048) on 64 V100s, D_PP =
D_DP = 8 (DT-FM's cost-model inputs, ``../shared/data/scenarios/dtfm_cases.json``). Per
tasklet and step, with ``c_pp`` the activations one tasklet sends over a stage boundary and
``c_dp`` one stage's gradients::

    bytes_ref   = 2 c_pp + 2 c_dp (D_DP - 1) / D_DP          (forward + backward, ring all-reduce)
                = 2 x 0.4712 GiB + 2 x 0.65 GB x 7/8 = 2.149 GB
    compute_ref = 23.64 PFLOP per step / 64 V100 / 125 TFLOPS  = 2.955 s   (DT-FM's nominal peak)

so the real links carry ``bytes_ref / compute_ref`` = 0.727 GB per second of compute. The
tiny job's ``bytes_tiny`` comes from its model shape by the same formula (fp32 on the wire,
its own D_PP x D_DP), and ``compute_tiny`` is measured here: one forward + backward of the
global batch through the whole model on one thread, divided by the N tasklets, times the
CPU contention ``max(1, N / cores)`` (N daemons share this machine's cores). One factor
scales every bandwidth of the scenario::

    bandwidth_factor = (bytes_tiny / compute_tiny) / (bytes_ref / compute_ref)

so that ``bytes / (bandwidth x compute)`` -- the communication-to-compute ratio per step
-- is the paper's on every link; one-way delays scale by ``compute_tiny / compute_ref`` (a
delay is time, not bytes). Both factors and every input are in the JSON (``regime``).
``--link-scale`` multiplies the bandwidth factor: the daemons spend CPU per step beyond the
forward + backward counted here (encoding, framing, p2pd, the event loops), so on a machine
whose cores the swarm keeps busy the matched links are not what paces a step; each arm's
``host_cpu`` (the daemons' CPU seconds per step and their share of the cores over the steady
steps, from ``/proc``) says which regime it ran in.

Per arm the JSON reports the measured seconds per step (the median over the tasklets of each
one's mean wall time from a step's end to the next one's, its first step left out; the bench's
polls of the owner's status give a second figure, ``s_per_step_polls``, over the steps it saw
after the first ``WARMUP_STEPS`` and before the last, and the window of ``host_cpu``), tokens/s, the
loss at equal tokens, bytes on the wire and the compression ratio by kind, the re-plans, the
compute part of a step (``compute_tiny`` x peers / tasklets) and the rest (link and
waiting); what the tasklets measured (``measured_phases``: seconds per step in forward and
backward passes with their encoding, waiting for and decoding neighbours' messages, sending
until acknowledged, and averaging with the optimizer step; mean and largest over tasklets,
each worker's first step left out); and the cost model's prediction: the committed
candidate's cost (the ``peerd`` objective on the roster's measured profiles and links, what
the planner optimised) with the ratio measured / predicted, and ``prediction``: the commit scored
again on the roster rebuilt from the owner's status after the arm, with the cost's parts (``pp``,
``dp``, ``norm``) and that roster, so that a reader can score it with another model. Every
tasklet's phases and seconds per step are in ``measured_phases.by_tasklet``. ``--png`` writes loss vs
wall-clock and vs tokens for every arm (when matplotlib is installed).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import click
import msgspec
import torch
import yaml
from click.core import ParameterSource

from peerd.bench import emit_json
from peerd.bench.rosters import committed_roster, daemon_profile, one_thread
from peerd.errors import ErrorCode, PeerdError
from peerd.jobs.scoring import RosterScorer
from peerd.jobs.service import roster_profile
from peerd.jobs.spec import parse_job_spec
from peerd.jobs.views import WIRE_KINDS
from peerd.localswarm import LocalSwarm, converged
from peerd.log import get_logger
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import RosterDevice
from peerd.sched.scenario import load_scenario

logger = get_logger(__name__)

SCENARIOS = {
    "world-wide": "dtfm-case4.yaml",
    "regional": "dtfm-case3.yaml",
    "multi-dc": "dtfm-case2.yaml",
}

# GPT3-XL on 64 V100s, DT-FM's cost-model inputs (dtfm_cases.json: model_training)
REF_MODEL = "GPT3-XL (1.3B), 24 layers, hidden 2048, seq 2048; 64 V100, D_PP = D_DP = 8"
REF_C_PP_BYTES = 0.47124922275543213 * 2**30  # 2048 hidden x 2048 seq x 2 B x 61.04 sequences per tasklet
REF_C_DP_BYTES = 0.65e9  # 1.3e9 params x 4 B x 3/24 layers
REF_D_DP = 8
REF_PFLOP_PER_STEP = 23.64  # 24 layers, 1024 sequences
REF_DEVICES = 64
REF_DEVICE_TFLOPS = 125.0  # V100 fp16 tensor-core peak, as the DT-FM scenarios list it

# the swarm keeping this share of the machine's cores busy means the cores pace a step, not the links
HOST_BOUND_SHARE = 0.8
WARMUP_STEPS = 2  # first steps: AC-SGD first visits, buffers and streams being set up
POLL_S = 0.5

# Record lifetime and refresh stay at the daemon's defaults (60 s, 20 s): nobody leaves in these
# runs, and the bench's former 10 s / 2 s made each daemon read the peers table every second,
# about a fifth of the CPU an arm-a step took on 8 daemons sharing 2 cores. Probes run often
# so that every link is measured before the first arm (a working peer's probes stand aside).
SWARM_OPTIONS = {
    "probe_interval": 4.0,
    "probe_budget": 5,
    "startup_timeout": 60.0,
    "shutdown_timeout": 10.0,
    "device": "cpu",
}


@dataclass(frozen=True)
class Arm:
    """One way of running the job."""

    name: str
    what: str
    placement: str = "search"
    seed: int = 0
    compressed: bool = False
    dp_only: bool = False


def arms(seeds: int) -> list[Arm]:
    return [
        Arm("a-peerd", "searched allocation, AC-SGD fwd 4 bit, bwd 8 bit, gradients 8 bit", compressed=True),
        Arm("b-peerd-fp32", "searched allocation, uncompressed"),
        *[
            Arm(f"c-random-s{k}", f"random placement (seed {k}), uncompressed", placement="random", seed=k)
            for k in range(seeds)
        ],
        Arm("d-dp-only", "d_pp = 1 (model on every peer), 8-bit gradient averaging", dp_only=True),
    ]


PEER_COUNTS = (4, 8, 16)  # arm d replicates over every peer: the global batch (16) splits evenly
MAX_STAGES = 4  # the tiny-4 GPT's blocks: a stage of its own for each at most


def shape(peers: int) -> tuple[int, int]:
    """(d_pp, d_dp) of arms a-c on ``peers`` (one of ``PEER_COUNTS``): 2 replicas of ``peers / 2``
    stages, at most ``MAX_STAGES`` of them (16 peers: 4 x 4)."""
    d_pp = min(MAX_STAGES, peers // 2)
    return d_pp, peers // d_pp


def base_spec(peers: int, steps: int) -> dict[str, Any]:
    """The job every arm trains: tiny-4 GPT on a small corpus, so examples repeat and AC-SGD engages."""
    d_pp, d_dp = shape(peers)
    return {
        "name": "wan",
        "kind": "pretrain",
        "model": {"preset": "tiny-4", "seed": 0},
        # 64-token windows, the last 16 held out and 62 to train on, 16 per step: every
        # example comes back within 4 steps and the delta path of AC-SGD engages (its paper's
        # multi-epoch regime; first visits go direct). The held-out loss after the last step
        # compares the arms at equal tokens on data none of them trained on.
        "data": {
            "source": "builtin",
            "seq_len": 64,
            "max_bytes": 5120,
            "validation": {"windows": 16, "interval": steps, "batches": 1},
        },
        "steps": steps,
        "global_batch": 16,
        "micro_batch": 2,
        "optimizer": {"name": "adamw", "lr": 0.003, "warmup_steps": 2, "schedule": "constant"},
        "parallel": {"d_pp": d_pp, "d_dp": d_dp},
        "compression": {
            "forward": "none",
            "forward_bits": None,
            "backward_bits": None,
            "gradient_bits": None,
        },
        "checkpoint_interval": steps,
        "min_peers": peers,
        "max_peers": peers,
        # one clock, but a loaded machine: 0.5 s skew (1 s windows) let roster entries of 8 busy
        # daemons miss the freeze (epoch after epoch with 7 of 8); 1 s gives 3.3 s windows
        "planning": {"time_budget_s": 3, "max_skew_s": 1.0},
    }


def arm_spec(arm: Arm, peers: int, steps: int) -> dict[str, Any]:
    spec = base_spec(peers, steps)
    spec["name"] = f"wan-{arm.name}"
    if arm.compressed:
        spec["compression"] = {"forward": "acsgd", "forward_bits": 4, "backward_bits": 8, "gradient_bits": 8}
    if arm.dp_only:
        spec["parallel"] = {"d_pp": 1, "d_dp": peers}
        spec["micro_batch"] = spec["global_batch"] // peers
        spec["compression"] = {**spec["compression"], "gradient_bits": 8}
    if arm.placement == "random":
        spec["planning"] = {**spec["planning"], "placement": "random", "placement_seed": arm.seed}
    parse_job_spec(spec)  # fail here, before any daemon starts, if an arm is not a valid job
    return spec


# -- the regime -----------------------------------------------------------------------------------


def comm_bytes_per_tasklet(c_pp: float, c_dp: float, d_dp: int) -> float:
    """Bytes one tasklet moves per step: activations forward and gradients back, and its ring share."""
    return 2 * c_pp + 2 * c_dp * (d_dp - 1) / d_dp


def tiny_sizes(spec: dict[str, Any]) -> dict[str, float]:
    """``c_pp`` and ``c_dp`` of the job (fp32 on the wire), from its model shape."""
    job = parse_job_spec(spec)
    family = job.model.family()
    d_pp, d_dp = job.parallel.known()["d_pp"], job.parallel.known()["d_dp"]
    params = sum(c.params for c in family.layer_costs(job.data.seq_len))
    c_pp = job.global_batch / d_dp * job.data.seq_len * family.hidden * 4
    c_dp = params / d_pp * 4
    return {"params": float(params), "c_pp_bytes": c_pp, "c_dp_bytes": c_dp, "d_pp": d_pp, "d_dp": d_dp}


def measure_compute(spec: dict[str, Any], repeats: int = 5) -> float:
    """Seconds of one forward + backward of the global batch through the whole model, one thread (median)."""
    job = parse_job_spec(spec)
    family = job.model.family()
    model = family.build()
    with one_thread():  # what each daemon gets (LocalSwarm: threads = 1)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, family.vocab_size, (job.global_batch, job.data.seq_len + 1), generator=g)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for mb in tokens.split(job.micro_batch):
                loss = family.loss(model(mb[:, :-1]), mb[:, 1:])
                loss.backward()
            times.append(time.perf_counter() - started)
        return median(times[1:])  # the first run warms allocator and kernels up


def regime(
    spec: dict[str, Any], peers: int, compute_full_s: float, cores: int, link_scale: float = 1.0
) -> dict[str, Any]:
    """The bandwidth and delay factors that give the tiny job GPT3-XL's communication-to-compute ratio.

    ``link_scale`` multiplies the bandwidth factor (``--link-scale``): below 1 the links carry the
    paper's bytes per compute-second more slowly, for a swarm whose daemons spend more CPU per step
    than the forward + backward this arithmetic counts (``host_cpu`` of each arm says how much).
    """
    ref_bytes = comm_bytes_per_tasklet(REF_C_PP_BYTES, REF_C_DP_BYTES, REF_D_DP)
    ref_compute = REF_PFLOP_PER_STEP * 1e15 / REF_DEVICES / (REF_DEVICE_TFLOPS * 1e12)
    tiny = tiny_sizes(spec)
    tiny_bytes = comm_bytes_per_tasklet(tiny["c_pp_bytes"], tiny["c_dp_bytes"], int(tiny["d_dp"]))
    contention = max(1.0, peers / cores)
    tiny_compute = compute_full_s / peers * contention
    matched = (tiny_bytes / tiny_compute) / (ref_bytes / ref_compute)
    factor = matched * link_scale
    return {
        "reference": {
            "model": REF_MODEL,
            "c_pp_bytes": REF_C_PP_BYTES,
            "c_dp_bytes": REF_C_DP_BYTES,
            "d_dp": REF_D_DP,
            "pflop_per_step": REF_PFLOP_PER_STEP,
            "devices": REF_DEVICES,
            "device_tflops": REF_DEVICE_TFLOPS,
            "bytes_per_tasklet_step": ref_bytes,
            "compute_s_per_tasklet_step": ref_compute,
            "bytes_per_compute_s": ref_bytes / ref_compute,
        },
        "tiny": {
            **tiny,
            "bytes_per_tasklet_step": tiny_bytes,
            "compute_full_batch_one_thread_s": compute_full_s,
            "cores": cores,
            "contention": contention,
            "compute_s_per_tasklet_step": tiny_compute,
            "bytes_per_compute_s": tiny_bytes / tiny_compute,
        },
        "bandwidth_factor": factor,
        "link_scale": link_scale,
        "delay_factor": tiny_compute / ref_compute,
        "arithmetic": (
            f"bytes/tasklet/step: ref 2*c_pp + 2*c_dp*7/8 = {ref_bytes / 1e9:.4g} GB, tiny {tiny_bytes / 1e6:.4g} MB; "
            f"compute/tasklet/step: ref 23.64 PFLOP/64/125 TFLOPS = {ref_compute:.4g} s, tiny "
            f"{compute_full_s:.4g} s/{peers} x {contention:.3g} = {tiny_compute:.4g} s; "
            f"bandwidth factor = ({tiny_bytes:.4g}/{tiny_compute:.4g}) / ({ref_bytes:.4g}/{ref_compute:.4g}) "
            f"= {matched:.4g}"
            + (f", x link scale {link_scale:.4g} = {factor:.4g}" if link_scale != 1.0 else "")
        ),
    }


def slowest_link_mbps(shaped: dict[str, Any]) -> float:
    """The narrowest link between two of the shaped scenario's peers (Mbit/s): what a ring or a
    pipeline of all peers has to cross."""
    regions = shaped["regions"]
    index = {name: i for i, name in enumerate(regions["names"])}
    used = [index[d["region"]] for d in shaped["devices"]]
    pairs = {(i, j) for k, i in enumerate(used) for j in used[k + 1 :]}
    rates = [regions["bandwidth_mbps"][i][j] for i, j in pairs if regions["bandwidth_mbps"][i][j] is not None]
    return float(min(rates)) if rates else math.inf


def crossover(spec_a: dict[str, Any], spec_d: dict[str, Any], compute_full_s: float, peers: int, cores: int,
              link_mbps: float, bandwidth_factor: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """When pipeline + compression (arm a) beats data-parallel only (arm d): per-step time of each as
    ``t(b) = C + V / b`` over the slowest link's ``b`` bytes/s, and the ``b`` where they meet.

    - C, compute per tasklet: the whole batch's forward + backward (one thread) / peers x the
      cores' contention; arm a adds its pipeline bubble, ``(S - 1) / M`` for S stages and M
      micro-batches per replica step (GPipe / 1F1B);
    - V, bytes a tasklet sends per step: arm a its activations forward and their gradients back
      (``c_pp``, at the forward / backward bits out of 32) plus its ring share of its stage's
      gradients (``2 (R - 1) / R c_dp``, at the gradient bits); arm d its ring share of the whole
      model's gradients (``2 (n - 1) / n x 4 params``, at its gradient bits).

    With ``C_a > C_d`` and ``V_a < V_d`` arm a wins below ``b* = (V_d - V_a) / (C_a - C_d)``. Links
    are taken as not overlapped with compute (the arms overlap alike little on one thread).
    ``bandwidth_factor`` (the regime's) turns the scaled crossover back into the real links' Mbit/s.
    """
    contention = max(1.0, peers / cores)
    per_peer = compute_full_s / peers * contention

    def side(spec: dict[str, Any]) -> dict[str, float]:
        job = parse_job_spec(spec)
        sizes = tiny_sizes(spec)
        stages, replicas = int(sizes["d_pp"]), int(sizes["d_dp"])
        micro = job.global_batch // replicas // job.micro_batch
        bits = job.compression
        fw, bw = (bits.forward_bits or 32) / 32, (bits.backward_bits or 32) / 32
        grad = (bits.gradient_bits or 32) / 32
        c_pp = sizes["c_pp_bytes"] if stages > 1 else 0.0
        ring = 2 * sizes["c_dp_bytes"] * (replicas - 1) / replicas * grad
        return {
            "stages": stages,
            "replicas": replicas,
            "micro_batches": micro,
            "compute_s": per_peer * (1 + (stages - 1) / micro),
            "bytes": c_pp * (fw + bw) + ring,
        }

    a, d = side(spec_a), side(spec_d)
    link_Bps = link_mbps * 1e6 / 8

    def step_s(x: dict[str, float]) -> float:
        return x["compute_s"] + x["bytes"] / link_Bps

    dc, dv = a["compute_s"] - d["compute_s"], d["bytes"] - a["bytes"]
    if dv <= 0:
        verdict, b_star = "d moves no more bytes than a: a never wins on bandwidth", None
    elif dc <= 0:
        verdict, b_star = (
            "a computes no more than d and moves fewer bytes: a wins at every bandwidth",
            math.inf,
        )
    else:
        b_star = dv / dc
        verdict = f"a wins below {b_star * 8 / 1e6:.4g} Mbit/s (scaled links), d above"
    return {
        "a": a,
        "d": d,
        "slowest_link_mbps": link_mbps,
        "predicted_a_over_d_tokens_per_s": step_s(d) / step_s(a),
        "crossover_mbps": None if b_star is None else b_star * 8 / 1e6,
        "crossover_unscaled_mbps": None if b_star is None else b_star * 8 / 1e6 / bandwidth_factor,
        "verdict": verdict,
        "arithmetic": (
            f"C_a = {per_peer:.4g} s x (1 + ({a['stages']:.0f}-1)/{a['micro_batches']:.0f}) = {a['compute_s']:.4g} s, "
            f"C_d = {d['compute_s']:.4g} s; V_a = {a['bytes'] / 1e6:.4g} MB, V_d = {d['bytes'] / 1e6:.4g} MB; "
            f"b* = (V_d - V_a) / (C_a - C_d)"
            + ("" if b_star is None or math.isinf(b_star) else f" = {b_star * 8 / 1e6:.4g} Mbit/s")
        ),
    }


def shaped_scenario(
    path: Path, names: list[str], bandwidth_factor: float, delay_factor: float
) -> dict[str, Any]:
    """A scenario for ``names``: the regions of ``path`` in blocks over the peers, links scaled."""
    source = load_scenario(path)
    if source.regions is None:
        raise PeerdError(
            f"{path.name} has no region matrices to map onto peers", code=ErrorCode.CONFIG_INVALID
        )
    regions = source.regions
    r, n = len(regions.names), len(names)

    def scale(rows: list[list[float | None]], k: float) -> list[list[float | None]]:
        return [[None if v is None else float(v) * k for v in row] for row in rows]

    return {
        "name": f"wan-{source.name}-{n}peers",
        "description": (
            f"{source.name} mapped onto {n} local peers (regions in blocks), bandwidths x{bandwidth_factor:.4g}, "
            f"delays x{delay_factor:.4g} (peerd bench wan)"
        ),
        "regions": {
            "names": list(regions.names),
            "delay_ms": scale(regions.delay_ms, delay_factor),
            "bandwidth_mbps": scale(regions.bandwidth_mbps, bandwidth_factor),
        },
        "devices": [{"id": name, "region": regions.names[i * r // n]} for i, name in enumerate(names)],
    }


# -- one arm on the swarm -------------------------------------------------------------------------


def trained_out(view: dict[str, Any], steps: int) -> bool:
    """Every tasklet of the committed epoch says it trained all steps (the job may still be ending).

    The loss curve seen may then miss the last steps: a step's loss counts once every replica
    of the newest epoch reported it, and a replica restored at the final step by a re-plan
    has none (``loss_points`` in the result says how many there are).
    """
    tasklets = (view.get("progress") or {}).get("tasklets") or []
    return bool(tasklets) and all(t["step"] >= steps for t in tasklets)


def run_arm(swarm: LocalSwarm, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Submit ``spec`` through peer 0 and follow it until it ends or has trained every step.

    A job whose tasklets all trained every step but that does not reach ``done`` (seen when a
    re-plan restores the final step) is cancelled, so the next arm gets the peers; its
    measurement is complete and ``ended`` says so.
    """
    owner = swarm.peers[0]
    submitted = time.monotonic()
    job = owner.control().call("submit", spec=spec)["job_id"]
    samples: list[tuple[float, int]] = []  # (seconds since submit, step)
    # a re-plan replaces a tasklet's progress record (and its loss points): keep what was seen
    curve: dict[int, float] = {}
    wire: dict[str, int] = {}
    view: dict[str, Any] = {}
    deadline = submitted + timeout
    ended = ""
    phases: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    # step -> (swarm CPU s, machine busy CPU s, swarm CPU s by process role)
    cpu: dict[int, tuple[float | None, float | None, dict[str, float] | None]] = {}
    while not ended:
        with contextlib.suppress(PeerdError):
            view = owner.control().call("job_status", job_id=job)
            progress = view.get("progress") or {}
            step = progress.get("step") or 0
            for k, loss in progress.get("losses") or []:
                curve.setdefault(int(k), float(loss))
            counters = {k: int(n) for k, n in (progress.get("bytes") or {}).items()}
            if sum(counters.values()) > sum(wire.values()):
                wire = (
                    counters  # one poll's counters (consistent); the largest, before any re-plan reset them
                )
            if view.get("state") in ("running", "recovering") and (not samples or step > samples[-1][1]):
                samples.append((time.monotonic() - submitted, step))
                roles = swarm.cpu_seconds_by_role()
                cpu[step] = (None if roles is None else sum(roles.values()), machine_busy_seconds(), roles)
            if view.get("state") in ("done", "failed", "cancelled"):
                ended = view["state"]
            elif trained_out(view, spec["steps"]):
                ended = f"all steps trained, job still {view.get('state')}: cancelled"
        if ended:
            phases = tasklet_phases(swarm, job)  # before a cancel closes the tasklets
            with contextlib.suppress(PeerdError):
                status = owner.status()  # the peers' profiles and links, to score the commit offline
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(PeerdError):
                owner.control().call("cancel", job_id=job)
            raise PeerdError(
                f"job {spec['name']} did not finish within {timeout:.0f} s (state {view.get('state')}, "
                f"step {(view.get('progress') or {}).get('step')})",
                code=ErrorCode.TIMEOUT,
            )
        time.sleep(POLL_S)
    wall = time.monotonic() - submitted
    if ended.endswith("cancelled") and ended != "cancelled":
        with contextlib.suppress(PeerdError):
            owner.control().call("cancel", job_id=job)
        with contextlib.suppress(PeerdError):
            swarm.wait_until(
                lambda vs: all(not _holds(v, job) for v in vs.values()),
                timeout=60,
                what="the cancelled job to stop",
            )
    replans = len(((view.get("planning") or {}).get("replans")) or [])
    return {
        "job_id": job,
        "samples": samples,
        "view": view,
        "wall_s": wall,
        "ended": ended,
        "replans": replans,
        "losses": sorted(curve.items()),
        "bytes": wire,
        "phases": phases,
        "cpu": cpu,
        "status": status,
    }


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of this machine spent not idle so far (``/proc/stat``); None elsewhere."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = sum(fields[3:5])  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # up to steal; guest time is inside user


def host_cpu(
    cpu: dict[int, tuple[float | None, float | None, dict[str, float] | None]],
    steady: list[tuple[float, int]],
    cores: int,
) -> dict[str, Any] | None:
    """The swarm's and the machine's CPU use per step over the steady window, and the regime it implies.

    A step of a swarm that keeps (nearly) every core of this machine busy is paced by the cores the
    daemons share, whatever the links: its ratios say little about the links. The swarm's CPU per
    step is also split by process role (daemons, their DHT processes, p2pd, other), what the cost
    model's host floor has to account for.
    """
    if len(steady) < 2:
        return None
    (t0, s0), (t1, s1) = steady[0], steady[-1]
    (swarm0, busy0, roles0), (swarm1, busy1, roles1) = cpu.get(s0, (None,) * 3), cpu.get(s1, (None,) * 3)
    if swarm0 is None or swarm1 is None or busy0 is None or busy1 is None or s1 <= s0 or t1 <= t0:
        return None
    wall = t1 - t0
    swarm_share = (swarm1 - swarm0) / (wall * cores)
    regime = (
        f"host-CPU-bound: the daemons kept {swarm_share:.0%} of {cores} cores busy; a step waits for cores, not links"
        if swarm_share >= HOST_BOUND_SHARE
        else f"link- or wait-bound: the daemons kept {swarm_share:.0%} of {cores} cores busy"
    )
    return {
        "swarm_cpu_s_per_step": (swarm1 - swarm0) / (s1 - s0),
        "swarm_cpu_s_per_step_by_role": (
            {role: (roles1[role] - roles0.get(role, 0.0)) / (s1 - s0) for role in roles1}
            if roles0 is not None and roles1 is not None
            else None
        ),
        "swarm_share_of_cores": swarm_share,
        "machine_share_of_cores": (busy1 - busy0) / (wall * cores),
        "over_steps": [s0, s1],
        "regime": regime,
    }


def tasklet_phases(swarm: LocalSwarm, job: str) -> list[dict[str, Any]]:
    """Every daemon's tasklet of ``job``: its stage, its replica and its measured seconds per step by
    phase (compute, wait, send, averaging, ...)."""
    out = []
    for peer in swarm.live_peers():
        with contextlib.suppress(PeerdError):
            tasklet = peer.control().call("job_status", job_id=job).get("tasklet") or {}
            if tasklet.get("phases_s"):
                out.append({k: tasklet.get(k) for k in ("stage", "replica", "s_per_step", "phases_s")})
    return out


def phase_summary(tasklets: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the mean and the largest of the tasklets' seconds per step, the phase that dominates,
    and each tasklet's phases by stage and replica (where the step's critical path runs)."""
    phases = [t["phases_s"] for t in tasklets]
    if not phases:
        return {}
    names = sorted({k for p in phases for k in p})
    mean = {k: sum(p.get(k, 0.0) for p in phases) / len(phases) for k in names}
    return {
        "tasklets": len(phases),
        "mean_s_per_step": mean,
        "max_s_per_step": {k: max(p.get(k, 0.0) for p in phases) for k in names},
        "dominant": max(mean, key=lambda k: mean[k]),
        "by_tasklet": sorted(tasklets, key=lambda t: (t.get("stage") or 0, t.get("replica") or 0)),
    }


def _holds(status: dict[str, Any], job: str) -> bool:
    """Whether a daemon's status view still shows ``job`` as active."""
    for j in status.get("jobs") or []:
        if j.get("job_id") == job and j.get("state") not in ("done", "failed", "cancelled"):
            return True
    return False


def arm_result(
    arm: Arm,
    spec: dict[str, Any],
    run: dict[str, Any],
    names: dict[str, str],
    reg: dict[str, Any],
    measured: RosterDevice | None = None,
) -> dict[str, Any]:
    cores = int(reg["tiny"]["cores"])
    view, samples = run["view"], run["samples"]
    progress = view.get("progress") or {}
    tokens_per_step = spec["global_batch"] * spec["data"]["seq_len"]
    # steady state: past the warm-up, and before the last step (its end-of-job teardown is not)
    steady = [(t, s) for t, s in samples if WARMUP_STEPS <= s < spec["steps"]]
    if len(steady) < 2 or steady[-1][1] <= steady[0][1]:
        steady = [(t, s) for t, s in samples if s >= 1]  # a fast arm outran the polls: every step seen
    polled = None
    if len(steady) >= 2 and steady[-1][1] > steady[0][1]:
        polled = (steady[-1][0] - steady[0][0]) / (steady[-1][1] - steady[0][1])
    # the tasklets' own clocks: every step after each one's first, end to end (a fast arm runs its
    # steady steps between two or three polls of a busy daemon)
    clocked = [float(t["s_per_step"]) for t in run.get("phases") or [] if t.get("s_per_step")]
    s_per_step, source = polled, "polls"
    if clocked:
        s_per_step, source = median(clocked), "tasklets"
    elif polled is None and progress.get("tokens_per_s"):  # the tasklets' last steps' rate (median)
        s_per_step, source = tokens_per_step / progress["tokens_per_s"], "daemons"
    first_seen: dict[int, float] = {}
    for t, s in samples:
        for k in range(max(first_seen, default=0) + 1, s + 1):
            first_seen[k] = t  # steps passed between two polls get the later time
    losses = run["losses"]
    alloc = view.get("allocation") or {}
    predicted = alloc.get("cost")
    d_pp = spec["parallel"]["d_pp"]
    compute = reg["tiny"]["compute_s_per_tasklet_step"] * (
        len(names) / max(1, d_pp * spec["parallel"]["d_dp"])
    )
    out: dict[str, Any] = {
        "arm": arm.name,
        "what": arm.what,
        "state": view.get("state"),
        "ended": run["ended"],
        "replans": run["replans"],
        "reason": view.get("reason"),
        "shape": {"d_pp": d_pp, "d_dp": spec["parallel"]["d_dp"]},
        "compression": spec["compression"],
        "placement": spec["planning"].get("placement", "search"),
        "pipelines": [[names.get(p, p) for p in pipe] for pipe in alloc.get("pipelines") or []],
        "job_id": run["job_id"],
        "commit": {k: alloc.get(k) for k in ("epoch", "stages", "spares", "roster")},
        "steps": spec["steps"],
        "wall_s": round(run["wall_s"], 2),
        "s_per_step": s_per_step,
        "s_per_step_source": source,
        "s_per_step_tasklets": {"min": min(clocked), "max": max(clocked)} if clocked else None,
        "s_per_step_polls": polled,
        "s_per_step_over_steps": [steady[0][1], steady[-1][1]] if polled else None,
        "step_seen_at_s": [[round(t, 2), s] for t, s in samples],
        "tokens_per_s": tokens_per_step / s_per_step if s_per_step else None,
        "tokens_per_s_daemons": progress.get("tokens_per_s"),
        "compute_s_per_step": compute,
        "link_and_wait_s_per_step": s_per_step - compute if s_per_step else None,
        "measured_phases": phase_summary(run.get("phases") or []),
        "host_cpu": host_cpu(run.get("cpu") or {}, steady, cores) if polled else None,
        "predicted_s_per_step": predicted,
        "measured_over_predicted": s_per_step / predicted if s_per_step and predicted else None,
        "prediction": prediction_parts(spec, alloc, run.get("status") or {}, measured),
        "measured_parts": measured_parts(run.get("phases") or [], s_per_step),
        "final_loss": losses[-1][1] if losses else None,
        "final_val_loss": progress.get("val_loss"),
        "loss_points": len(losses),
        "bytes": run["bytes"],
        "compression_ratio": wire_ratio(run["bytes"]),
        "compression_by_kind": {k: wire_ratio(run["bytes"], (k,)) for k in WIRE_KINDS},
        "loss_vs_tokens": [[s * tokens_per_step, loss] for s, loss in losses],
        "loss_vs_wall_s": [[round(first_seen[s], 2), loss] for s, loss in losses if s in first_seen],
    }
    return out


def prediction_parts(
    spec: dict[str, Any], alloc: dict[str, Any], status: dict[str, Any], measured: RosterDevice | None = None
) -> dict[str, Any] | None:
    """The committed allocation scored again on the roster rebuilt from a daemon's status after the
    arm (the links as probed then, which may have moved since the commit; each device's op, traffic
    and element costs from ``measured``, the profile every daemon read), with the parts of the
    cost (``peerd.sched.cost_peerd``: ``pp`` the pipelined forward and backward, ``dp`` the slowest
    stage's all-reduce, ``norm`` the gradient norm's trip, ``update`` the slowest stage's optimizer
    step), and that roster, so that a reader can score it with another model."""
    if not status or not alloc.get("stages"):
        return None
    try:
        roster = committed_roster(status, alloc, measured)
        allocation = Allocation(tuple(tuple(s) for s in alloc["stages"]), tuple(alloc.get("spares") or ()))
        cost = RosterScorer(parse_job_spec(spec)).cost(roster, allocation)
    except KeyError as exc:
        return {"error": f"the status after the arm has no row for member {exc}"}
    except PeerdError as exc:  # the commit does not fit the roster as the status shows it
        return {"error": str(exc)}
    return {
        "s_per_step": cost.total,
        "parts": cost.parts,
        "roster": msgspec.to_builtins(roster.entries),
    }


def measured_parts(tasklets: list[dict[str, Any]], s_per_step: float | None) -> dict[str, float] | None:
    """The step's measured time in the cost model's parts, from the tasklets' phases.

    ``pp``: the pipelined forward and backward, up to the last tasklet's end of it (the largest
    compute + wait + send of any tasklet: the slowest replica's first stage, in 1F1B); ``norm``: the
    norm's trip alone, as the tasklet that waited least for it saw it (the one whose stage averaged
    last); ``update``: the slowest optimizer step; ``dp``: the rest of the step (the slowest stage's
    all-reduce with its wait, and what runs between steps). The model's parts have the same names.
    """
    phases = [t["phases_s"] for t in tasklets if t.get("phases_s")]
    if not phases or not s_per_step:
        return None
    pp = max(p.get("compute", 0.0) + p.get("wait", 0.0) + p.get("send", 0.0) for p in phases)
    norm = min(p.get("norm", 0.0) for p in phases)
    update = max(p.get("update", 0.0) for p in phases)
    return {"pp": pp, "dp": max(0.0, s_per_step - pp - norm - update), "norm": norm, "update": update}


def wire_ratio(counters: dict[str, int], kinds: tuple[str, ...] = WIRE_KINDS) -> float | None:
    """Raw over wire bytes of ``kinds`` (activations, backward gradients, averaging), as the daemons count them."""
    wire = sum(counters.get(k, 0) for k in kinds)
    return sum(counters.get(f"{k}_raw", 0) for k in kinds) / wire if wire else None


# -- the whole bench ------------------------------------------------------------------------------


def scenario_path(scenario: str) -> Path:
    if scenario in SCENARIOS:
        path = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / SCENARIOS[scenario]
    else:
        path = Path(scenario)
    if not path.is_file():
        raise click.BadParameter(
            f"{path} is not a file (built in: {', '.join(SCENARIOS)})", param_hint="--scenario"
        )
    return path


def wan(
    *,
    peers: int = 8,
    scenario: str = "world-wide",
    seeds: int = 3,
    steps: int = 20,
    arm_timeout: float = 300.0,
    only: tuple[str, ...] = (),
    png: str | None = None,
    link_scale: float = 1.0,
) -> dict[str, Any]:
    path = scenario_path(scenario)
    chosen = [a for a in arms(seeds) if not only or any(a.name.startswith(o) for o in only)]
    specs = {a.name: arm_spec(a, peers, steps) for a in chosen}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    reference_spec = arm_spec(Arm("b", ""), peers, steps)  # the regime is set by the uncompressed pipeline
    reg = regime(reference_spec, peers, measure_compute(reference_spec), cores, link_scale)
    names = [f"peer{i}" for i in range(peers)]
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peerd-wan-") as tmp:
        root = Path(tmp)
        shaped = shaped_scenario(path, names, reg["bandwidth_factor"], reg["delay_factor"])
        (root / "scenario.yaml").write_text(yaml.safe_dump(shaped, sort_keys=False))
        cache = root / "device_profiles.json"
        measured = roster_profile(daemon_profile(cache), "")  # what every daemon declares from it
        options = {**SWARM_OPTIONS, "scenario": str(root / "scenario.yaml"), "profile_cache": str(cache)}
        swarm = LocalSwarm(peers, root / "s", options=options, names=names, ready_timeout=180)
        swarm.start()
        try:
            swarm.wait_until(  # every ordered pair's link is probed: the wait grows with their number
                lambda v: converged(v, names),
                timeout=180 * max(1.0, peers / 8) ** 2,
                what="every daemon to measure the others",
            )
            ids = {p.info.peer_id: p.name for p in swarm.peers if p.info is not None}
            for arm in chosen:
                logger.info("arm %s: %s", arm.name, arm.what)
                try:
                    run = run_arm(swarm, specs[arm.name], arm_timeout)
                    results.append(arm_result(arm, specs[arm.name], run, ids, reg, measured))
                except PeerdError as exc:
                    results.append({"arm": arm.name, "what": arm.what, "error": str(exc)})
                logger.info("arm %s: %s", arm.name, _brief(results[-1]))
        finally:
            swarm.close()
    out = {
        "benchmark": "wan",
        "peers": peers,
        "machine": {
            "cores": cores,
            "note": f"{peers} daemons share {cores} cores, one compute thread each",
            # what a message costs this machine's CPU at each end, as every daemon declares it
            "message_us": measured.message_s * 1e6 if measured.message_s else None,
            "wire_byte_ns": measured.wire_byte_s * 1e9 if measured.wire_byte_s else None,
            # and what a compressing codec call costs it (AC-SGD, 8-bit)
            "codec_us": measured.codec_s * 1e6 if measured.codec_s else None,
            "codec_value_ns": measured.codec_value_s * 1e9 if measured.codec_value_s else None,
        },
        "scenario": {"file": path.name, "mapped": shaped["description"], "regions": shaped["devices"]},
        "regime": reg,
        "job": {k: reference_spec[k] for k in ("model", "data", "steps", "global_batch", "micro_batch")},
        "arms": results,
        "ratios": ratios(results),
        "crossover": crossover(
            specs.get("a-peerd") or arm_spec(arms(1)[0], peers, steps),
            specs.get("d-dp-only") or arm_spec(arms(1)[-1], peers, steps),
            reg["tiny"]["compute_full_batch_one_thread_s"],
            peers,
            cores,
            slowest_link_mbps(shaped),
            reg["bandwidth_factor"],
        ),
        "seconds": round(time.monotonic() - started, 1),
    }
    if png:
        out["png"] = write_plot(results, Path(png), f"peerd bench wan: {path.name}, {peers} peers")
    return out


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    keys = (
        "ended",
        "s_per_step",
        "tokens_per_s",
        "predicted_s_per_step",
        "final_loss",
        "final_val_loss",
        "replans",
    )
    return ", ".join(f"{k}={r.get(k)}" for k in keys)


def _rate(results: list[dict[str, Any]], prefix: str) -> float | None:
    rates = [r["tokens_per_s"] for r in results if r["arm"].startswith(prefix) and r.get("tokens_per_s")]
    return median(rates) if rates else None


def _loss_at(r: dict[str, Any], tokens: float) -> float | None:
    points = [(t, loss) for t, loss in r.get("loss_vs_tokens") or [] if t <= tokens]
    return points[-1][1] if points else None


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s ratios between arms (c: the median over its seeds) and the loss at equal tokens."""
    a, b, c, d = (_rate(results, p) for p in ("a-", "b-", "c-", "d-"))
    out: dict[str, Any] = {
        "a_over_c_tokens_per_s": a / c if a and c else None,
        "a_over_b_tokens_per_s": a / b if a and b else None,
        "b_over_c_tokens_per_s": b / c if b and c else None,
        "a_over_d_tokens_per_s": a / d if a and d else None,
    }
    done = [r for r in results if r.get("loss_vs_tokens")]
    if done:
        tokens = min(r["loss_vs_tokens"][-1][0] for r in done)
        out["equal_tokens"] = tokens
        out["loss_at_equal_tokens"] = {r["arm"]: _loss_at(r, tokens) for r in done}
        la = out["loss_at_equal_tokens"].get("a-peerd")
        lc = [v for k, v in out["loss_at_equal_tokens"].items() if k.startswith("c-") and v is not None]
        if la is not None and lc:
            out["a_loss_over_c_loss"] = la / median(lc)
    # the held-out loss after the last step: every arm trains the same tokens, so it is at equal tokens
    held = {r["arm"]: r["final_val_loss"] for r in results if r.get("final_val_loss") is not None}
    if held:
        out["val_loss"] = held
        hc = [v for k, v in held.items() if k.startswith("c-")]
        if "a-peerd" in held and hc:
            out["a_val_loss_over_c_val_loss"] = held["a-peerd"] / median(hc)
    return out


def write_plot(results: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """Loss vs wall-clock and vs tokens for every arm (None when matplotlib is not installed)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for r in results:
        for ax, key in ((left, "loss_vs_wall_s"), (right, "loss_vs_tokens")):
            points = r.get(key) or []
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=r["arm"], linewidth=1.2)
    left.set_xlabel("seconds since submit")
    right.set_xlabel("tokens")
    for ax in (left, right):
        ax.set_ylabel("training loss (nats/byte)")
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


@click.command("wan")
@click.option(
    "--peers",
    default=8,
    show_default=True,
    help="Daemons in the local swarm: 4, 8 or 16 (4 stages x 4 replicas).",
)
@click.option(
    "--scenario",
    default="world-wide",
    show_default=True,
    help=f"Link scenario: {', '.join(SCENARIOS)} (DT-FM cases 4, 3, 2) or a scenario YAML path.",
)
@click.option("--seeds", default=3, show_default=True, help="Random-placement seeds (arm c).")
@click.option("--steps", default=20, show_default=True, help="Training steps per arm.")
@click.option("--arm", "only", multiple=True, help="Run only arms whose name starts with this (a, b, c, d).")
@click.option(
    "--quick", is_flag=True, help="CI smoke: defaults of 4 peers, 1 seed, 8 steps (under 5 minutes)."
)
@click.option(
    "--link-scale",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.001, max=1000.0),
    help="Multiply the matched bandwidth factor by this (below 1: slower links, a more link-bound "
    "regime; each arm's host_cpu says whether the cores or the links pace its steps).",
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--png", default=None, type=click.Path(dir_okay=False), help="Write the loss plot here.")
def command(
    peers: int,
    scenario: str,
    seeds: int,
    steps: int,
    only: tuple[str, ...],
    quick: bool,
    link_scale: float,
    out: str | None,
    png: str | None,
) -> None:
    """Four arms of one GPT job on a shaped local swarm: tokens/s, loss vs time and tokens, predicted vs measured."""
    if quick:  # smaller defaults; what the command line gives explicitly still counts
        ctx = click.get_current_context()
        given = {
            n
            for n in ("peers", "seeds", "steps")
            if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE
        }
        peers = peers if "peers" in given else 4
        seeds = seeds if "seeds" in given else 1
        steps = steps if "steps" in given else 8
    if peers not in PEER_COUNTS:
        raise click.BadParameter(
            f"one of {', '.join(map(str, PEER_COUNTS))}: the 16-sequence batch splits evenly over "
            "the replicas of every arm (d: one per peer)",
            param_hint="--peers",
        )
    if seeds < 1 or steps < WARMUP_STEPS + 2:
        raise click.BadParameter(f"needs --seeds >= 1 and --steps >= {WARMUP_STEPS + 2}")
    result = wan(
        peers=peers, scenario=scenario, seeds=seeds, steps=steps, only=only, png=png, link_scale=link_scale
    )
    result["command"] = "peerd bench wan " + " ".join(
        [f"--peers {peers}", f"--scenario {scenario}", f"--seeds {seeds}", f"--steps {steps}"]
        + [f"--arm {o}" for o in only]
        + ([f"--link-scale {link_scale:g}"] if link_scale != 1.0 else [])
        + (["--quick"] if quick else [])
    )
    emit_json(result, out)
    if any("error" in r for r in result["arms"]):
        raise SystemExit(1)  # the JSON says which arm failed and why
