"""``peerd demo``: a local swarm on loopback trains a small GPT end to end, live, then shuts down cleanly.

Starts the daemons, waits until they know each other, submits the demo job (the built-in tiny
GPT on the built-in corpus, sized to the swarm: 3 stages x 2 replicas from six daemons), shows
planning and training live, prints a summary (final loss, tokens/s, compression savings),
writes a loss plot, and stops every daemon. ``--no-job`` only shows the swarm.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from peerd.cli.options import CliError, command
from peerd.cli.render import console as make_console
from peerd.cli.render import follow_job, render_status


@command("""
  peerd demo                          6 daemons plan and train the demo GPT (a few minutes), then clean up
  peerd demo --steps 40 --plot l.png  a shorter run; the loss plot goes to l.png
  peerd demo --no-job --peers 3       only start a swarm and show the status table
  peerd demo --peers 2 --json         the final status (with the job) as JSON, for scripts
  peerd demo --keep                   keep state directories, logs and checkpoints afterwards
""")
@click.option(
    "--peers",
    "size",
    type=click.IntRange(min=1, max=16),
    default=6,
    help="Daemons to start (each runs its own p2pd). The demo job uses 3x2 of six, fewer below.",
)
@click.option(
    "--timeout", type=click.FloatRange(min=5), default=90.0, help="Seconds to wait for the swarm to converge."
)
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    help="Where the daemons keep their state and logs (default: a temporary directory).",
)
@click.option("--keep", is_flag=True, help="Keep the state directories and logs afterwards.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the final status view as JSON instead of tables."
)
@click.option("--job/--no-job", default=True, help="Submit and train the demo job.")
@click.option(
    "--spec",
    "spec_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Train this job spec instead of the built-in demo job (its min_peers must fit --peers).",
)
@click.option("--steps", type=click.IntRange(min=1), help="Override the job's steps.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Where to write the loss plot (PNG). Default: DIR/loss.png with --dir, else ./peerd-demo-loss.png.",
)
@click.option(
    "--job-timeout",
    type=click.FloatRange(min=10),
    default=900.0,
    help="Seconds the job may take from submit to its end.",
)
def demo(
    size: int,
    timeout: float,
    root: str | None,
    keep: bool,
    as_json: bool,
    job: bool,
    spec_file: str | None,
    steps: int | None,
    plot: str | None,
    job_timeout: float,
) -> None:
    """Show peerd training a model on this machine, in a few minutes, with nothing to set up.

    Starts SIZE `peerd join` daemons on loopback (the first starts a swarm, the others join
    it) and waits until every daemon sees all of them ONLINE with a measured device profile
    and links. Then submits the demo job, shows planning (roster, island search, votes,
    commit) and training (step, loss, tokens/s) live, prints a summary and writes a loss
    plot, and shuts every daemon down (each announces OFFLINE). Exit code 1 when the job
    does not finish.
    """
    from peerd.localswarm import LocalSwarm, converged, describe

    console = make_console(stderr=as_json)
    workdir = Path(root) if root else Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    # Short timers so that the demo converges in seconds; the defaults suit real swarms.
    options: dict[str, Any] = {
        "record_ttl": 20.0,
        "refresh_interval": 3.0,
        "probe_interval": 5.0,
        "shutdown_timeout": 8.0,
        "threads": 1,  # the daemons share this machine: one compute thread each, not all cores each
    }
    regions = ["eu-west", "us-east"]
    peer_options = [{"region": regions[i * 2 // size]} for i in range(size)]
    started = time.monotonic()
    swarm = LocalSwarm(size, workdir, options=options, peer_options=peer_options, ready_timeout=timeout)
    succeeded = False
    try:
        console.print(f"starting {size} daemons on loopback (state in {workdir}) ...")
        swarm.start()  # PeerUnavailable reaches main: exit code 3
        console.print(
            f"all {size} daemons are up after {time.monotonic() - started:.1f} s; waiting for them to meet ..."
        )
        names = [p.name for p in swarm.peers]
        # a timeout (PeerdError) reaches main: exit code 1
        views = swarm.wait_until(
            lambda v: converged(v, names), timeout=timeout, what="every peer to see every other"
        )
        view = views[names[0]]
        console.print(f"converged after {time.monotonic() - started:.1f} s:\n{describe(views)}", markup=False)
        if not as_json:
            console.print(render_status(view))
        summary = None
        if job:
            plot_path = (
                Path(plot) if plot else (Path(root) / "loss.png" if root else Path("peerd-demo-loss.png"))
            )
            summary = _run_job(swarm, console, size, spec_file, steps, plot_path, job_timeout)
            view = swarm.peers[0].status()
        if as_json:
            if summary is not None:
                view["demo"] = summary
            click.echo(json.dumps(view, sort_keys=True))
        elif job:
            console.print(render_status(view))
        if summary is not None and summary["state"] != "done":
            raise CliError(f"the demo job ended {summary['state']}; logs are in {workdir}")
        succeeded = True
    finally:  # also on Ctrl-C, which main() then reports as "Aborted." (exit code 130)
        console.print("shutting the swarm down ...")
        swarm.close()
        if succeeded and not keep and root is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep or not succeeded:  # a failed demo keeps its logs for the error message to point at
            console.print(f"state and logs kept in {workdir}")
    console.print(f"done in {time.monotonic() - started:.1f} s")


def _run_job(
    swarm: Any,
    console: Console,
    size: int,
    spec_file: str | None,
    steps: int | None,
    plot: Path,
    limit: float,
) -> dict[str, Any]:
    """Submit the demo job through peer0, show it live until it ends, print the summary, write the plot."""
    from peerd.cli.plot import write_loss_plot
    from peerd.jobs.demo import demo_spec, summarize
    from peerd.jobs.records import normalized_spec
    from peerd.jobs.spec import parse_job_spec
    from peerd.loading import load_mapping

    base = load_mapping(spec_file) if spec_file else None
    spec = parse_job_spec(demo_spec(size, steps, base), source=spec_file or "the demo job")
    client = swarm.peers[0].control(timeout=30.0)
    submitted = time.monotonic()
    job_id = client.call("submit", spec=normalized_spec(spec), source=spec_file or "demo")["job_id"]
    console.print(
        f"submitted job {job_id} ({spec.name}: {spec.steps} steps, {spec.parallel.d_pp}x{spec.parallel.d_dp})"
    )
    names = {p.info.peer_id: p.name for p in swarm.peers if p.info is not None}
    view = follow_job(lambda: client.call("job_status", job_id=job_id), console, names=names, limit=limit)
    console.print()
    summary = summarize(view, submitted)
    summary["seconds"] = round(time.monotonic() - submitted, 1)
    written = write_loss_plot(view, plot)
    summary["plot"] = str(written) if written else None
    console.print(_summary_text(summary))
    return summary


def _summary_text(s: dict[str, Any]) -> Text:
    lines = [f"job {s['job_id']} {s['state']} after {s['seconds']:.0f} s"]
    if s["first_loss"] is not None:
        lines.append(f"  loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} over {s['steps']} steps")
    if s["tokens_per_s"]:
        lines.append(f"  throughput {s['tokens_per_s']:,.0f} tokens/s")
    if s["compression_ratio"]:
        wire, raw = sum(s["wire_bytes"].values()), sum(s["raw_bytes"].values())
        lines.append(
            f"  on the wire {wire / 1e6:.1f} MB instead of {raw / 1e6:.1f} MB as fp32 "
            f"({s['compression_ratio']:.1f}x less, {s['bytes_saved'] / 1e6:.1f} MB saved)"
        )
        for kind, ratio in (s.get("compression_by_kind") or {}).items():
            lines.append(
                f"    {kind} {s['wire_bytes'][kind] / 1e6:.2f} MB instead of {s['raw_bytes'][kind] / 1e6:.2f} MB "
                f"({ratio:.1f}x)"
            )
    if s.get("regime"):
        lines.append(f"  compression regime: {s['regime']}")
    if s["allocation_cost"] is not None:
        best = f" (best island {s['island_best_cost']:.4g})" if s["island_best_cost"] else ""
        lines.append(
            f"  allocation {str(s['allocation_hash'])[:12]}: cost {s['allocation_cost']:.4g} s/step{best}"
        )
    if s.get("plot"):
        lines.append(f"  loss plot: {s['plot']}")
    return Text("\n".join(lines))
