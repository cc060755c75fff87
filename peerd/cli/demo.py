"""``peerd demo``: start a local swarm on loopback, wait until every peer sees every other, show it, clean up."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from peerd.cli import EXIT_FAILED, EXIT_STARTUP
from peerd.errors import ErrorCode, PeerdError, PeerUnavailable


class DemoFailed(click.ClickException):
    exit_code = EXIT_FAILED


class DemoStartupFailed(click.ClickException):
    exit_code = EXIT_STARTUP


@click.command(
    epilog="""\b
Examples:
  peerd demo                     3 daemons, then a status table, then a clean shutdown
  peerd demo --peers 2 --json    the final status as JSON (for scripts)
  peerd demo --keep              keep the state directories and logs to look at afterwards"""
)
@click.option(
    "--peers",
    "size",
    type=click.IntRange(min=1, max=16),
    default=3,
    show_default=True,
    help="Daemons to start (each runs its own p2pd; 3 suit a 2-core laptop).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=5),
    default=90.0,
    show_default=True,
    help="Seconds to wait for the swarm to converge.",
)
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the daemons keep their state and logs (default: a temporary directory).",
)
@click.option("--keep", is_flag=True, help="Keep the state directories and logs afterwards.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the final status view as JSON instead of tables."
)
def demo(size: int, timeout: float, root: str | None, keep: bool, as_json: bool) -> None:
    """Show peerd working on this machine, in about a minute, with nothing to set up.

    Starts SIZE `peerd join` daemons on loopback (the first starts a swarm, the others
    join it), waits until every daemon sees all of them ONLINE with a measured device
    profile and a measured link to every other peer, prints the status table, then
    shuts them all down (each announces OFFLINE) and removes the temporary state.
    """
    from peerd.cli.swarm import render_status
    from peerd.localswarm import LocalSwarm, converged, describe

    console = Console(stderr=as_json)
    workdir = Path(root) if root else Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    # Short timers so that the demo converges in seconds; the defaults suit real swarms.
    options: dict[str, Any] = {
        "record_ttl": 20.0,
        "refresh_interval": 3.0,
        "probe_interval": 5.0,
        "shutdown_timeout": 8.0,
    }
    started = time.monotonic()
    swarm = LocalSwarm(size, workdir, options=options, ready_timeout=timeout)
    try:
        console.print(f"starting {size} daemons on loopback (state in {workdir}) ...")
        try:
            swarm.start()
        except PeerUnavailable as exc:
            raise DemoStartupFailed(str(exc)) from None
        console.print(
            f"all {size} daemons are up after {time.monotonic() - started:.1f} s; waiting for them to meet ..."
        )
        names = [p.name for p in swarm.peers]
        try:
            views = swarm.wait_until(
                lambda v: converged(v, names), timeout=timeout, what="every peer to see every other"
            )
        except PeerdError as exc:
            if exc.code == ErrorCode.TIMEOUT:
                raise DemoFailed(str(exc)) from None
            raise
        view = views[names[0]]
        console.print(f"converged after {time.monotonic() - started:.1f} s:\n{describe(views)}", markup=False)
        if as_json:
            click.echo(json.dumps(view, sort_keys=True))
        else:
            console.print(render_status(view))
    except KeyboardInterrupt:
        raise click.Abort() from None  # after the cleanup below: "Aborted.", exit code 1
    finally:
        console.print("shutting the swarm down ...")
        swarm.close()
        if not keep and root is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep:
            console.print(f"state and logs kept in {workdir}")
    console.print(f"done in {time.monotonic() - started:.1f} s")
