"""``peerd plan SCENARIO``: search an allocation offline and print it (or its JSON)."""

from __future__ import annotations

import json

import click

from peerd.cli.options import command
from peerd.sched.planner import OBJECTIVES, PlanResult
from peerd.sched.planner import plan as run_plan
from peerd.sched.scenario import load_scenario


@command("""
  peerd plan configs/scenarios/dtfm-case0.yaml               DT-FM's cost, 10 s of search
  peerd plan scenario.yaml --objective peerd --seed 3        compute, memory and spares too
  peerd plan scenario.yaml --generations 50 --json | jq .total
""")
@click.argument("scenario", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--objective",
    type=click.Choice(sorted(OBJECTIVES)),
    default="dtfm",
    help="dtfm: DT-FM's communication yardstick; peerd: iteration time with compute, memory, spares.",
)
@click.option("--seed", type=int, default=0, help="Search seed (same seed, same plan).")
@click.option(
    "--time-budget", type=click.FloatRange(min=0.1), default=10.0, help="Seconds of search at most."
)
@click.option("--generations", type=click.IntRange(min=0), help="Stop after this many generations.")
@click.option("--json", "as_json", is_flag=True, help="Print the machine-readable result.")
def plan(
    scenario: str, objective: str, seed: int, time_budget: float, generations: int | None, as_json: bool
) -> None:
    """Plan which device runs which (stage, replica) tasklet for SCENARIO (YAML/JSON)."""
    sc = load_scenario(scenario)
    result = run_plan(sc, objective, seed=seed, time_budget=time_budget, generations=generations)
    if as_json:
        data = result.to_dict()
        data["scenario"] = sc.name
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(_render(sc.name, len(sc.devices), result))


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
