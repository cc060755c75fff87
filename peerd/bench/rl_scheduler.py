"""``peerd bench rl-scheduler``: the RL scheduler's searches against each other and against the baselines.

Sections of the JSON result, all measured in this run:

- ``tiny``: exact MILP vs brute force (device-level enumeration) on instances of <= 8 devices:
  equal optimum, and the seconds of each.
- ``medium``: hybrid vs exact on 16-32 devices: the hybrid's gap to the proven optimum, the time
  ratio, and a quality-vs-budget curve (hybrid at growing evaluation budgets); the target (within
  5 % at >= 10x less time) is read at the curve's smallest budget within 5 %
  (``first_budget_within_5pct``, ``time_ratio_within_5pct``).
- ``scenarios``: the 64-GPU scenarios (four networks x Qwen-like 4B / 8B / 14B): the hybrid
  plan's predicted iteration time and seconds to plan, the verl-like and StreamRL-like
  predictions in the same cost model (with verl-like's chosen ``fsdp_size``, micro-batches and
  rollout tp, ``verl_like_config``), and the speedups over them; ``scenarios_async`` the same
  with async depth ``--async`` (baselines at that depth too).
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from peerd.bench import emit_json
from peerd.sched.rl.brute import brute_force
from peerd.sched.rl.cluster import Cluster, load_rl_scenario, rl_scenario
from peerd.sched.rl.evaluate import Evaluator
from peerd.sched.rl.exact import ExactConfig, solve
from peerd.sched.rl.hybrid import HybridConfig, search
from peerd.sched.rl.planner import plan_rl
from peerd.sched.rl.workload import ModelSize, Workload
from peerd.sched.scenario import Device, Regions, Scenario

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "rl"
NETWORKS = ("single-region", "multi-region", "multi-country", "multi-continent")
MODELS = ("qwen-4b", "qwen-8b", "qwen-14b")
QWEN_4B = ModelSize(name="qwen-4b", params=4.02e9, layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128)
SPECS = {"a100": (312.0, 80.0, 2039.0), "l40s": (362.0, 48.0, 864.0), "l4": (121.0, 24.0, 300.0)}


def synthetic(name: str, sites: list[tuple[str, str, int]], wan_ms: float, wan_mbps: float) -> Scenario:
    """Devices (site, GPU model, count), 0.1 ms / 100 Gbit/s inside a site, ``wan`` between sites."""
    names = sorted({s for s, _, _ in sites})
    delay = [[0.1 if a == b else wan_ms for b in names] for a in names]
    bw = [[100000.0 if a == b else wan_mbps for b in names] for a in names]
    devices = []
    for site, gpu, count in sites:
        tf, mem, mbw = SPECS[gpu]
        devices += [
            Device(id=f"{gpu}-{site}-{i}", region=site, tflops=tf, memory_gb=mem, memory_bandwidth_gb_s=mbw)
            for i in range(count)
        ]
    regions = Regions(names=names, delay_ms=delay, bandwidth_mbps=bw)  # type: ignore[arg-type]
    return Scenario(devices=devices, regions=regions, name=name)


def tiny_cases() -> list[tuple[Scenario, Workload]]:
    small = ModelSize(
        name="qwen-1.5b", params=1.5e9, layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128
    )
    w = Workload(actor=small, prompts=64, name="qwen-1.5b")
    return [
        (synthetic("tiny-6", [("a", "a100", 2), ("a", "l40s", 1), ("b", "l4", 3)], 10.0, 1000.0), w),
        (synthetic("tiny-7-async", [("a", "a100", 2), ("b", "l40s", 2), ("c", "l4", 3)], 20.0, 2000.0),
         Workload(actor=small, prompts=64, staleness=1, name="qwen-1.5b")),
        (synthetic("tiny-6-ppo", [("a", "a100", 2), ("b", "l40s", 2), ("b", "l4", 2)], 5.0, 5000.0),
         Workload(actor=small, prompts=64, algo="ppo", name="qwen-1.5b")),
    ]  # fmt: skip


def medium_cases() -> list[tuple[Scenario, Workload]]:
    w = Workload(actor=QWEN_4B, prompts=256, name="qwen-4b")
    return [
        (synthetic("medium-16", [("a", "a100", 4), ("a", "l40s", 4), ("b", "l40s", 4), ("b", "l4", 4)], 10.0, 5000.0), w),
        (synthetic("medium-24", [("a", "a100", 8), ("b", "l40s", 8), ("c", "l4", 8)], 30.0, 2000.0), w),
        (synthetic("medium-32", [("a", "a100", 8), ("a", "l40s", 8), ("b", "l40s", 8), ("b", "l4", 8)], 20.0, 2000.0), w),
        (synthetic("medium-24-async", [("a", "a100", 8), ("b", "l40s", 8), ("c", "l4", 8)], 30.0, 2000.0),
         Workload(actor=QWEN_4B, prompts=256, staleness=1, name="qwen-4b")),
    ]  # fmt: skip


def bench_tiny() -> dict:
    out = {}
    for sc, w in tiny_cases():
        cl = Cluster.of(rl_scenario(sc, w))
        t0 = time.perf_counter()
        _, _, brute = brute_force(Evaluator(cl, w))
        t1 = time.perf_counter()
        exact = solve(Evaluator(cl, w), ExactConfig())
        t2 = time.perf_counter()
        out[sc.name] = {
            "devices": cl.n,
            "brute_force_seconds_per_iteration": round(brute.seconds, 4),
            "exact_seconds_per_iteration": round(exact.score.seconds, 4),
            "exact_equals_brute_force": bool(
                abs(exact.score.seconds - brute.seconds) <= 1e-6 * brute.seconds
            ),
            "exact_gap": exact.gap,
            "brute_force_time_s": round(t1 - t0, 3),
            "exact_time_s": round(t2 - t1, 3),
        }
        click.echo(f"{sc.name}: exact {exact.score.seconds:.3f} brute {brute.seconds:.3f}", err=True)
    return out


def first_within(curve: list[dict], gap: float) -> dict | None:
    """The curve's point of smallest budget whose gap to the optimum is at most ``gap``, if any.

    An anytime search is judged by how soon it is good enough, not by its largest budget.
    """
    good = [c for c in curve if c["gap_to_exact"] <= gap]
    return min(good, key=lambda c: c["budget"]) if good else None


def bench_medium(budgets: list[int], seed: int) -> dict:
    out = {}
    for sc, w in medium_cases():
        cl = Cluster.of(rl_scenario(sc, w))
        t0 = time.perf_counter()
        exact = solve(Evaluator(cl, w), ExactConfig())
        exact_s = time.perf_counter() - t0
        curve = []
        for b in budgets:
            t0 = time.perf_counter()
            h = search(Evaluator(cl, w), HybridConfig(budget=b, seed=seed))
            curve.append(
                {
                    "budget": b,
                    "evaluations": h.evaluations,
                    "seconds_per_iteration": round(h.score.seconds, 4),
                    "gap_to_exact": round(h.score.seconds / exact.score.seconds - 1.0, 5),
                    "time_s": round(time.perf_counter() - t0, 3),
                }
            )
        main = curve[-1]
        first = first_within(curve, 0.05)
        out[sc.name] = {
            "devices": cl.n,
            "exact_seconds_per_iteration": round(exact.score.seconds, 4),
            "exact_proven_gap": exact.gap,
            "exact_time_s": round(exact_s, 2),
            "exact_columns": exact.columns,
            "hybrid_seconds_per_iteration": main["seconds_per_iteration"],
            "hybrid_gap_to_exact": main["gap_to_exact"],
            "hybrid_time_s": main["time_s"],
            "hybrid_within_5pct": bool(main["gap_to_exact"] <= 0.05),
            "time_ratio_exact_over_hybrid": round(exact_s / max(main["time_s"], 1e-9), 1),
            "first_budget_within_5pct": first["budget"] if first else None,
            "time_ratio_within_5pct": round(exact_s / max(first["time_s"], 1e-9), 1) if first else None,
            "at_least_10x_faster": bool(first and exact_s >= 10 * first["time_s"]),
            "quality_vs_budget": curve,
        }
        click.echo(
            f"{sc.name}: gap {main['gap_to_exact']:.4f} exact {exact_s:.1f}s hybrid {main['time_s']:.1f}s",
            err=True,
        )
    return out


def bench_scenarios(
    folder: Path, networks: list[str], models: list[str], budget: int, seed: int, staleness: int = 0
) -> dict:
    out: dict[str, dict] = {}
    for net in networks:
        for model in models:
            rl = load_rl_scenario(folder / f"{net}.yaml", model)
            r = plan_rl(rl, "hybrid", seed=seed, budget=budget, staleness=staleness)
            verl, stream = r.baselines["verl_like"], r.baselines["streamrl_like"]
            out.setdefault(net, {})[model] = {
                "hybrid_seconds_per_iteration": round(r.seconds, 3),
                "hybrid_tokens_per_s": r.report["throughput"]["tokens_per_s"],
                "plan_time_s": r.search["seconds"],
                "within_60s": bool(r.search["seconds"] <= 60.0),
                "groups": [f"{'+'.join(g['tasks'])} x{len(g['devices'])}" for g in r.report["groups"]],
                "idle_devices": len(r.report["idle"]),
                "verl_like_seconds": verl["iteration_seconds"],
                "verl_like_config": verl.get("config"),
                "streamrl_like_seconds": stream["iteration_seconds"],
                "speedup_vs_verl_like": verl["speedup"],
                "speedup_vs_streamrl_like": stream["speedup"],
            }
            conf = verl.get("config") or {}
            click.echo(
                f"{net} {model}: {r.seconds:.1f}s x{verl['speedup']} vs verl "
                f"({verl['iteration_seconds']}s at fsdp_size {conf.get('fsdp_size')}, "
                f"micro-batch {conf.get('micro_batch')}, tp{conf.get('rollout_tp')}) in {r.search['seconds']}s",
                err=True,
            )
    return out


def summary(scen: dict) -> dict:
    vs = [
        m["speedup_vs_verl_like"] for net in scen.values() for m in net.values() if m["speedup_vs_verl_like"]
    ]
    per_net = {
        net: round(sum(m["speedup_vs_verl_like"] for m in models.values()) / len(models), 3)
        for net, models in scen.items()
    }
    return {
        "mean_speedup_vs_verl_like": round(sum(vs) / len(vs), 3) if vs else None,
        "max_speedup_vs_verl_like": max(vs) if vs else None,
        "mean_speedup_vs_verl_like_per_network": per_net,
    }


@click.command("rl-scheduler")
@click.option(
    "--budget", type=int, default=1500, show_default=True, help="Hybrid evaluations per 64-GPU scenario."
)
@click.option(
    "--medium-budgets", default="100,400,1500", show_default=True, help="Hybrid budgets of the curve."
)
@click.option("--networks", default=",".join(NETWORKS), show_default=True)
@click.option("--models", default=",".join(MODELS), show_default=True)
@click.option(
    "--async",
    "staleness",
    type=int,
    default=1,
    show_default=True,
    help="Also plan the 64-GPU scenarios with this async depth (section scenarios_async; 0 = skip).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="Smaller budgets, 8B only.")
@click.option(
    "--scenarios", type=click.Path(file_okay=False, path_type=Path), default=SCENARIO_DIR, show_default=True
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the JSON here.")
def command(
    budget: int,
    medium_budgets: str,
    networks: str,
    models: str,
    staleness: int,
    seed: int,
    quick: bool,
    scenarios: Path,
    out: str | None,
) -> None:
    """RL scheduler: exact vs brute force, hybrid vs exact, and plans vs verl/StreamRL-like baselines (JSON)."""
    curve = [int(b) for b in medium_budgets.split(",") if b]
    nets = [n for n in networks.split(",") if n]
    sizes = [m for m in models.split(",") if m]
    if quick:
        budget, curve, sizes = budget // 3, [b // 3 for b in curve], ["qwen-8b"]
    started = time.perf_counter()
    scen = bench_scenarios(scenarios, nets, sizes, budget, seed)
    result: dict[str, object] = {
        "tiny": bench_tiny(),
        "medium": bench_medium(curve, seed),
        "scenarios": scen,
        "summary": summary(scen),
        "settings": {
            "budget": budget,
            "medium_budgets": curve,
            "seed": seed,
            "quick": quick,
            "async": staleness,
        },
    }
    if staleness > 0:
        late = bench_scenarios(scenarios, nets, sizes, budget, seed, staleness)
        result["scenarios_async"] = late
        result["summary_async"] = summary(late)
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit_json(result, out)
