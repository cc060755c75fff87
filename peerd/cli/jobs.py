"""``peerd submit``, ``peerd cancel``, ``peerd jobs``, ``peerd fetch``, and the job views ``peerd status`` shows.

Every command talks to the local daemon through its control socket (``--home`` picks which
daemon): the daemon holds the identity that signs job records, so the job's owner is the
daemon's peer. ``submit`` validates the spec here first and refuses it with one line per bad
field (exit 2) before anything is published.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from peerd.cli import EXIT_FAILED, EXIT_STARTUP, EXIT_USAGE
from peerd.cli.swarm import config_options
from peerd.config import load_config
from peerd.errors import ErrorCode, PeerdError

STATE_STYLE = {
    "pending": "yellow",
    "planning": "cyan",
    "running": "blue",
    "done": "green",
    "failed": "red",
    "cancelled": "magenta",
}
FINAL = ("done", "failed", "cancelled")
SPARK = "▁▂▃▄▅▆▇█"


class CommandFailed(click.ClickException):
    exit_code = EXIT_FAILED


class UsageFailed(click.ClickException):
    exit_code = EXIT_USAGE


class NoDaemon(click.ClickException):
    exit_code = EXIT_STARTUP


def _client(config_file: str | None, overrides: dict[str, Any], timeout: float = 30.0) -> Any:
    from peerd.control import ControlClient

    config = load_config(config_file, overrides).resolved()
    return ControlClient(config.control_socket, timeout=timeout)  # type: ignore[arg-type]


def _call(client: Any, method: str, **params: Any) -> Any:
    """One control call with peerd's exit codes: 3 no daemon, 2 bad input, 1 anything else refused."""
    from peerd.control import DaemonNotRunning

    try:
        return client.call(method, **params)
    except DaemonNotRunning as exc:
        raise NoDaemon(
            f"{exc}.\nStart one with `peerd join` or point --home at a running daemon's state directory."
        ) from None
    except PeerdError as exc:
        if exc.code == ErrorCode.CONFIG_INVALID:
            raise UsageFailed(str(exc)) from None
        raise CommandFailed(str(exc)) from None


_DAEMON = ("home", "control_socket")


# -- submit ---------------------------------------------------------------------------------------


@click.command(
    epilog="""\b
Examples:
  peerd submit configs/jobs/gpt-tiny-demo.yaml            prints the job id
  peerd submit configs/jobs/gpt-small.yaml --wait         follow it to the end
  peerd submit job.yaml --home /tmp/peer2                 submit through another local daemon"""
)
@click.argument("spec_file", metavar="SPEC", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--wait", is_flag=True, help="Follow the job (planning, then step, loss, tokens/s) until it ends."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the submit result (and with --wait the final job) as JSON."
)
@config_options(only=_DAEMON)
def submit(spec_file: str, wait: bool, as_json: bool, config_file: str | None, **overrides: Any) -> None:
    """Validate SPEC, sign it with the local daemon's key and publish it to the swarm; prints the job id.

    A spec with problems is refused before anything is published, with one line per bad
    field (exit code 2). Exit code 1 when the job (with --wait) fails or is cancelled.
    """
    from peerd.jobs.records import normalized_spec
    from peerd.jobs.spec import load_job_spec

    spec = load_job_spec(spec_file)  # JobSpecError (exit 2) lists every bad field
    client = _client(config_file, overrides)
    result = _call(client, "submit", spec=normalized_spec(spec), source=spec_file)
    job_id = result["job_id"]
    if as_json and not wait:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for warning in result.get("warnings") or []:
        click.echo(f"warning: {warning}", err=True)
    if not as_json:
        click.echo(job_id)
    if wait:
        final = follow(client, job_id)  # the bar goes to stderr, so --json output stays clean
        if as_json:
            click.echo(json.dumps(final, sort_keys=True))
        if final["state"] != "done":
            raise CommandFailed(
                f"job {job_id} ended {final['state']}: {final.get('reason') or 'see peerd status'}"
            )


def follow(client: Any, job_id: str, *, interval: float = 1.0, quiet: bool = False) -> dict[str, Any]:
    """Poll ``job_status`` and draw a progress bar (state, step/steps, loss, tokens/s) until the job ends."""
    console = Console(stderr=True, quiet=quiet)
    columns = [
        TextColumn("[bold]{task.fields[state]:<9}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(job_id[:8], total=1, state="pending", loss="-", tps="-")
        while True:
            view = _call(client, "job_status", job_id=job_id)
            progress = view.get("progress") or {}
            loss, tps = progress.get("loss"), progress.get("tokens_per_s")
            bar.update(
                task,
                total=max(progress.get("steps") or 1, 1),
                completed=progress.get("step") or 0,
                state=view["state"],
                loss=f"{loss:.4f}" if loss is not None else "-",
                tps=f"{tps:,.0f}" if tps else "-",
            )
            if view["state"] in FINAL:
                return view
            time.sleep(interval)


# -- cancel ---------------------------------------------------------------------------------------


@click.command()
@click.argument("job_id", metavar="ID")
@click.option("--reason", default="", help="Why (shown in peerd status).")
@config_options(only=_DAEMON)
def cancel(job_id: str, reason: str, config_file: str | None, **overrides: Any) -> None:
    """Cancel job ID (or a unique prefix of it). Only the job's owner may: exit code 1 with NOT_OWNER otherwise."""
    result = _call(_client(config_file, overrides), "cancel", job_id=job_id, reason=reason)
    click.echo(f"job {result['job_id']} is {result['state']}" + ("" if result["changed"] else " (already)"))


# -- jobs -----------------------------------------------------------------------------------------


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@config_options(only=_DAEMON)
def jobs(as_json: bool, config_file: str | None, **overrides: Any) -> None:
    """List the jobs of the swarm: id, name, state, owner, step, loss, throughput, allocation."""
    views = _call(_client(config_file, overrides), "jobs")
    if as_json:
        click.echo(json.dumps(views, sort_keys=True))
        return
    Console().print(jobs_table(views) if views else Text("no jobs in this swarm yet (peerd submit SPEC)"))


# -- fetch ----------------------------------------------------------------------------------------


@click.command()
@click.argument("job_id", metavar="ID")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory for model.pt and job.json.",
)
@click.option(
    "--from",
    "roots",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="Extra checkpoint roots to search (e.g. other local daemons' HOME/checkpoints); repeat for several.",
)
@config_options(only=_DAEMON)
def fetch(
    job_id: str, out_dir: str, roots: tuple[str, ...], config_file: str | None, **overrides: Any
) -> None:
    """Assemble the latest checkpoint of every stage of job ID into one model file (OUT/model.pt).

    Searches the local daemon's HOME/checkpoints and every --from directory; the result loads
    with ``peerd.jobs.fetch.load_model`` (a ``peerd.models.gpt.GPT`` with its weights).
    """
    from peerd.jobs.fetch import assemble
    from peerd.jobs.spec import parse_job_spec

    config = load_config(config_file, overrides).resolved()
    view = _call(_client(config_file, overrides), "job_status", job_id=job_id)
    spec = parse_job_spec(view["spec_mapping"])
    search = [Path(str(config.home)) / "checkpoints", *(Path(r) for r in roots)]
    try:
        result = assemble(view["job_id"], spec, search, Path(out_dir))
    except PeerdError as exc:
        raise CommandFailed(str(exc)) from None
    click.echo(
        f"wrote {result.path} (step {result.step}, {result.stages} stages, {result.parameters:,} parameters)"
    )


# -- rendering (also used by peerd status) --------------------------------------------------------


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode block sparkline of ``values`` (downsampled to ``width`` by averaging buckets)."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        values = [
            sum(b) / len(b)
            for b in (
                values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(width)
            )
        ]
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def jobs_table(views: list[dict[str, Any]]) -> Table:
    table = Table(title="jobs", title_justify="left", caption="* owned by this peer", caption_justify="left")
    for col, kw in (
        ("id", {"no_wrap": True}),
        ("name", {"no_wrap": True}),
        ("state", {"no_wrap": True}),
        ("step", {"justify": "right", "no_wrap": True}),
        ("loss", {"justify": "right"}),
        ("tok/s", {"justify": "right"}),
        ("allocation", {"no_wrap": True}),
    ):
        table.add_column(col, **kw)
    for v in views:
        p = v.get("progress") or {}
        alloc = v.get("allocation")
        shape = (
            f"{len(alloc['stages'])}x{len(alloc['stages'][0])} {alloc['allocation_hash'][:8]}"
            if alloc
            else "-"
        )
        table.add_row(
            v["short_id"] + ("*" if v.get("owner_is_me") else ""),
            v.get("name") or "-",
            Text(v["state"], style=STATE_STYLE.get(v["state"], "")),
            f"{p.get('step', 0)}/{p.get('steps', '?')}",
            f"{p['loss']:.4f}" if p.get("loss") is not None else "-",
            f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "-",
            shape,
        )
    return table


def job_panel(view: dict[str, Any], names: dict[str, str]) -> RenderableType:
    """One job: header, pipelines (stage -> peer, with regions), loss sparkline, throughput, bytes by kind."""
    parts: list[RenderableType] = []
    p = view.get("progress") or {}
    head = Text(f"job {view['job_id']}  ")
    head.append(view["state"].upper(), style=STATE_STYLE.get(view["state"], ""))
    head.append(f"  {view.get('name') or ''}  step {p.get('step', 0)}/{p.get('steps', '?')}")
    parts.append(head)
    alloc = view.get("allocation")
    if alloc:
        regions = alloc.get("regions") or {}
        parts.append(
            Text(
                f"  allocation {alloc['allocation_hash'][:12]} (epoch {alloc['epoch']}, cost {alloc['cost']:.4g} s/step, "
                f"layers {alloc.get('layers') or 'even'})"
            )
        )
        for j, pipe in enumerate(alloc["pipelines"]):
            hops = [
                f"s{s}:{names.get(peer, peer[-8:])}" + (f"({regions[peer]})" if regions.get(peer) else "")
                for s, peer in enumerate(pipe)
            ]
            parts.append(Text(f"  replica {j}: " + " → ".join(hops)))
    losses = [v for _, v in p.get("losses") or []]
    if losses:
        parts.append(Text(f"  loss {losses[0]:.3f} {sparkline(losses)} {losses[-1]:.3f}"))
    if p.get("tokens_per_s"):
        parts.append(Text(f"  throughput {p['tokens_per_s']:,.0f} tokens/s"))
    sent = p.get("bytes") or {}
    wire = [(k, n) for k, n in sorted(sent.items()) if not k.endswith("_raw") and n]
    if wire:
        text = ", ".join(f"{k} {_human_bytes(n)}" for k, n in wire)
        ratio = p.get("compression_ratio")
        parts.append(Text(f"  on the wire: {text}" + (f" ({ratio:.1f}x less than fp32)" if ratio else "")))
    return Group(*parts)


def render_jobs(view: dict[str, Any]) -> RenderableType | None:
    """The jobs section of ``peerd status`` (None when the swarm has no jobs)."""
    jobs_views = view.get("jobs") or []
    if not jobs_views:
        return None
    names = {peer["peer_id"]: peer["name"] for peer in view.get("peers", [])}
    return Group(
        jobs_table(jobs_views), *(job_panel(v, names) for v in jobs_views if v["state"] != "pending")
    )
