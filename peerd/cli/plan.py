"""``peerd plan SCENARIO``: search an allocation offline and print it (or its JSON).

``--kind train`` (default) places pipeline/data-parallel tasklets of one training job;
``--kind rl`` places the tasks of an RL post-training workflow (``peerd.sched.rl``).
"""

from __future__ import annotations

import json

import click

from peerd.cli.options import CliError, command
from peerd.errors import ConfigError
from peerd.log import get_logger
from peerd.sched.planner import OBJECTIVES, PlanResult
from peerd.sched.planner import plan as run_plan
from peerd.sched.scenario import Scenario, load_scenario

log = get_logger(__name__)


@command("""
  peerd plan configs/scenarios/dtfm-case0.yaml               DT-FM's cost, 10 s of search
  peerd plan scenario.yaml --objective peerd --seed 3        compute, memory and spares too
  peerd plan scenario.yaml --generations 50 --json | jq .total
  peerd plan --kind rl configs/scenarios/rl/multi-continent.yaml --workload qwen-14b
  peerd plan --kind rl configs/scenarios/rl/single-region.yaml --algo ppo --async 1 --json
  peerd plan --kind rl tiny.yaml --mode exact                 MILP optimum and its proven gap
""")
@click.argument("scenario", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--kind",
    type=click.Choice(["train", "rl"]),
    default="train",
    help="train: tasklets of one training job; rl: the tasks of an RL post-training workflow.",
)
@click.option(
    "--mode",
    type=click.Choice(["hybrid", "exact"]),
    default="hybrid",
    help="rl: hybrid search (successive halving + GA) or the exact MILP (small swarms).",
)
@click.option("--algo", type=click.Choice(["grpo", "ppo"]), help="rl: override the workload's algorithm.")
@click.option(
    "--async",
    "staleness",
    type=int,
    help="rl: async depth K (generation runs up to K iterations ahead; 0 = synchronous).",
)
@click.option("--workload", help="rl: a workload of workloads.yaml beside SCENARIO instead of its own.")
@click.option(
    "--budget", type=click.IntRange(min=1), default=3000, help="rl: evaluations of the hybrid search."
)
@click.option(
    "--objective",
    type=click.Choice(sorted(OBJECTIVES)),
    default="dtfm",
    help="dtfm: DT-FM's communication yardstick; peerd: iteration time with compute, memory, spares "
    "(and CPU devices that share a machine's cores: devices[].host, with what a message costs it and "
    "its daemons' idle load: message_us, wire_byte_ns, idle_cores; each layer's ops, traffic and "
    "element units: model.layer_work, at devices[].launch_us, memory_bandwidth_gb_s, element_ns).",
)
@click.option("--seed", type=int, default=0, help="Search seed (same seed, same plan).")
@click.option(
    "--time-budget", type=click.FloatRange(min=0.1), default=10.0, help="Seconds of search at most."
)
@click.option("--generations", type=click.IntRange(min=0), help="Stop after this many generations.")
@click.option("--json", "as_json", is_flag=True, help="Print the machine-readable result.")
def plan(
    scenario: str,
    kind: str,
    mode: str,
    algo: str | None,
    staleness: int | None,
    workload: str | None,
    budget: int,
    objective: str,
    seed: int,
    time_budget: float,
    generations: int | None,
    as_json: bool,
) -> None:
    """Plan which device runs which (stage, replica) tasklet, or which RL task, for SCENARIO (YAML/JSON)."""
    ctx = click.get_current_context()
    given = {
        p.name
        for p in ctx.command.params
        if p.name and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE
    }
    if kind == "rl":
        for name in sorted(given & {"objective", "time_budget", "generations"}):
            log.warning("--%s applies to --kind train and is ignored with --kind rl", name.replace("_", "-"))
        _plan_rl(scenario, mode, algo, staleness, workload, budget, seed, as_json)
        return
    for name in sorted(given & {"mode", "algo", "staleness", "workload", "budget"}):
        raise CliError(f"--{'async' if name == 'staleness' else name} needs --kind rl", 2)
    sc = load_scenario(scenario)
    if objective != "peerd":
        _refuse_unpriced(sc, f"the {objective} objective prices no compute (plan with --objective peerd)")
    result = run_plan(sc, objective, seed=seed, time_budget=time_budget, generations=generations)
    if as_json:
        data = result.to_dict()
        data["scenario"] = sc.name
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(_render(sc.name, len(sc.devices), result))


def _plan_rl(
    path: str,
    mode: str,
    algo: str | None,
    staleness: int | None,
    workload: str | None,
    budget: int,
    seed: int,
    as_json: bool,
) -> None:
    from peerd.sched.rl.cluster import load_rl_scenario
    from peerd.sched.rl.planner import plan_rl

    rl = load_rl_scenario(path, workload)
    _refuse_unpriced(rl.scenario, "peerd plan --kind rl prices every device as its own machine")
    result = plan_rl(rl, mode, algo=algo, staleness=staleness, seed=seed, budget=budget)  # type: ignore[arg-type]
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(render_rl(result.to_dict(), len(rl.scenario.devices)))


def _refuse_unpriced(sc: Scenario, why: str) -> None:
    """Shared machines (``devices[].host``) slow the compute of the ``peerd`` objective and of an rl
    job's consensus scoring, ``model.layer_work`` adds to the ``peerd`` objective's compute and
    ``training.averaging_work`` to its exchanges; where
    a plan cannot price them, a scenario that names them is refused."""
    for i, d in enumerate(sc.devices):
        if d.host is not None:
            raise ConfigError(
                f"devices[{i}].host", f"a shared machine would be ignored: {why}; or remove host"
            )
    if sc.model is not None and sc.model.layer_work is not None:
        raise ConfigError("model.layer_work", f"the layers' work would be ignored: {why}; or remove it")
    if sc.training is not None and sc.training.averaging_work is not None:
        raise ConfigError(
            "training.averaging_work", f"the averaging's work would be ignored: {why}; or remove it"
        )


def render_rl(d: dict, n: int) -> str:
    """The text form of an RL plan: groups with devices and layouts, the time and its parts, memory, baselines."""
    lines = [
        f"scenario   {d['scenario']} ({n} devices)   workload {d['workload'] or '-'} ({d['algo']}, "
        + (f"async k={d['staleness']})" if d["staleness"] else "synchronous)"),
        f"iteration  {d['iteration_seconds']:.2f} s   {d['throughput']['tokens_per_s']:.0f} tokens/s   "
        f"critical path: {' > '.join(d['breakdown']['critical_path'])}",
        _search_line(d),
        "",
        "groups:",
    ]
    for k, g in enumerate(d["groups"]):
        where = ", ".join(f"{r} x{c}" for r, c in sorted(g["regions"].items()))
        lines.append(
            f"  {k}: {' + '.join(g['tasks'])}   {len(g['devices'])} devices ({where})   busy {g['busy_seconds']:.2f} s"
        )
        for task, lay in g["layouts"].items():
            order = " stage-major" if lay["stage_major"] else ""
            lines.append(
                f"       {task:<13} dp{lay['dp']} pp{lay['pp']} tp{lay['tp']}{order}   {lay['seconds']:.2f} s"
            )
    if d["idle"]:
        lines.append(
            f"  idle: {len(d['idle'])} devices ({', '.join(d['idle'][:8])}{', ...' if len(d['idle']) > 8 else ''})"
        )
    b = d["breakdown"]
    moves = [f"{t['payload']} {t['from']}->{t['to']} {t['seconds']:.2f} s" for t in b["transfers"]]
    lines.append(f"transfers  {', '.join(moves) or 'none'}   weight sync {b['weight_sync']:.2f} s")
    fullest = max(d["memory"].items(), key=lambda kv: kv[1]["used_gb"] / kv[1]["usable_gb"])
    lines.append(
        f"memory     fullest device {fullest[0]}: {fullest[1]['used_gb']:.1f} of {fullest[1]['usable_gb']:.1f} GB "
        "(--json lists every device)"
    )
    lines.append("baselines (same cost model):")
    for name, base in d["baselines"].items():
        if base["speedup"] is None:
            lines.append(f"  {name:<14} infeasible: {base.get('shortfall', 'no plan')}")
        else:
            lines.append(
                f"  {name:<14} {base['iteration_seconds']:.2f} s   this plan is {base['speedup']:.2f}x faster"
                + _verl_config(base.get("config"))
            )
    return "\n".join(lines)


def _verl_config(c: dict | None) -> str:
    """The verl-like baseline's chosen configuration (fsdp_size, micro-batches, rollout tp)."""
    if not c or c.get("fsdp_size") is None:
        return ""
    micro = ", ".join(f"{t} {m}" for t, m in c["micro_batch"].items())
    return f"   (fsdp_size {c['fsdp_size']}, micro-batch {micro}, rollout tp{c['rollout_tp']})"


def _search_line(d: dict) -> str:
    s = d["search"]
    if d["mode"] == "exact":
        return f"search     exact MILP: {s['columns']} columns, {s['groupings']} groupings, gap {s['gap']:.2%}, {s['seconds']:.1f} s"
    return f"search     hybrid: {s['arms']} arms, {s['evaluations']} evaluations, seed {s['seed']}, {s['seconds']:.1f} s"


def _render(name: str, n: int, r: PlanResult) -> str:
    a = r.allocation
    lines = [
        f"scenario   {name} ({n} devices)",
        f"objective  {r.objective}   shape {r.shape.d_pp} stages x {r.shape.d_dp} replicas"
        + (f"   {len(a.spares)} spares" if a.spares else ""),
        f"cost       {r.total:.3f} s/iteration   " + "   ".join(f"{k} {v:.3f}" for k, v in r.parts.items()),
        f"search     {r.seconds:.1f} s, {r.generations} generations, seed {r.seed}   hash {r.digest[:16]}",
        "",
        "stages (replicas left to right):",
    ]
    width = max(len(d) for d in a.devices)
    for k, stage in enumerate(a.stages):
        layers = f" [{a.layers[k]} layers]" if a.layers else ""
        lines.append(f"  {k:>2}{layers}: " + " ".join(d.ljust(width) for d in stage))
    lines.append("pipelines (regions, first stage to last):")
    lines.extend(f"  {j:>2}: {s}" for j, s in enumerate(r.regions))
    if a.spares:
        lines.append("spares: " + " ".join(a.spares))
    if r.note:
        lines.append(r.note)
    return "\n".join(lines)
