"""``peerd join``, ``status``, ``leave``, ``pause``, ``resume``: run a peer, see the swarm, and the volunteer's controls.

The flags of both commands are generated from ``peerd.config.DaemonConfig``
fields, so an option and its help text are declared once, in the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from peerd.cli.options import DAEMON, CliError, call, client_of, command, config_options, no_daemon
from peerd.cli.render import show_status
from peerd.config import DaemonConfig, load_config
from peerd.errors import PeerdError

LEAVE_SLACK_S = 10.0  # beyond the daemon's grace period and shutdown timeout, before `peerd leave` gives up

# -- peerd join ---------------------------------------------------------------------------------------


@command("""
  peerd join                                   start a new swarm; prints the address others join with
  peerd join --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/QmX...   join a running swarm
  peerd join --initial-peers MADDR_A --initial-peers MADDR_B      any one that answers is enough
  peerd join                                   later, same home: rejoins through the peers it remembers
  peerd join --host-maddrs /ip4/0.0.0.0/tcp/31337 --announce-maddrs /ip4/203.0.113.7/tcp/31337
  peerd join --config peer.yaml --device cuda:1
Stop with `peerd leave`, Ctrl-C or SIGTERM: the peer hands its work over (at most
--leave-grace-s), announces OFFLINE and exits; a second Ctrl-C skips the grace period.
`peerd pause` / `peerd resume` stop and restart training here without leaving.
""")
@config_options()
def join(config_file: str | None, **overrides: Any) -> None:
    """Run a peer: profile this device, measure links to other peers, advertise, wait for work.

    Prints the multiaddrs other volunteers pass to --initial-peers, then runs until
    interrupted. Exit code 3 when the daemon cannot start (p2pd, unreachable initial
    peers), 2 for invalid options.
    """
    config = load_config(config_file, overrides)
    if config.log_level:
        logging.getLogger().setLevel(config.log_level)
    from peerd.daemon import ReadyInfo, format_ready_line, run_daemon

    def on_ready(info: ReadyInfo) -> None:
        click.echo(f"peerd is ONLINE as {info.name} ({info.peer_id}) in swarm {info.swarm!r}.")
        click.echo("Others can join with:")
        for maddr in info.maddrs:
            click.echo(f"  peerd join --initial-peers {maddr}")
        click.echo(f"Local status: peerd status --home {info.home}")
        click.echo(format_ready_line(info))  # machine-readable: peerd.localswarm waits for it

    run_daemon(config, on_ready)  # PeerUnavailable reaches main: exit code 3


# -- peerd status -------------------------------------------------------------------------------------


@command("""
  peerd status                      the swarm as your local daemon sees it
  peerd status --watch              refresh in place every 2 s (Ctrl-C to quit); piped: a frame per refresh
  peerd status --json | jq '.peers[] | {name, state, tflops}'
  peerd status --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/QmX...   no local daemon needed
  peerd status --home /tmp/peer2    the daemon that uses another state directory
""")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (one document per refresh).")
@click.option(
    "--watch",
    is_flag=True,
    help="Keep refreshing until Ctrl-C (in place on a terminal, else a new frame each time).",
)
@click.option(
    "--interval", type=click.FloatRange(min=0.2), default=2.0, help="Seconds between refreshes with --watch."
)
@click.option(
    "--direct",
    is_flag=True,
    help="Skip the local daemon; read the swarm as a short-lived client through --initial-peers.",
)
@config_options(only=("home", "control_socket", "swarm", "initial_peers", "startup_timeout"))
def status(
    as_json: bool, watch: bool, interval: float, direct: bool, config_file: str | None, **overrides: Any
) -> None:
    """Show the peers of the swarm (id, name, device, TFLOPS, memory, state, last seen) and the link matrix.

    Reads through the local daemon when one runs (its control socket in --home), else
    joins the swarm briefly as a client through --initial-peers. Exit code 3 when
    neither a daemon nor an initial peer answers.
    """
    config = load_config(config_file, overrides).resolved()
    from peerd.control import DaemonNotRunning

    client = client_of(config, timeout=20.0)
    if not direct:
        try:
            first = client.call("status")
        except DaemonNotRunning as exc:
            if not config.initial_peers:
                raise no_daemon(
                    exc,
                    "point --home at its state directory, or pass --initial-peers MADDR to read the swarm directly",
                ) from None
        except PeerdError as exc:
            raise CliError(f"the local daemon did not answer: {exc}") from None
        else:
            show_status(lambda: client.call("status"), first, as_json=as_json, watch=watch, interval=interval)
            return
    with _direct_reader(config) as read:  # PeerUnavailable reaches main: exit code 3
        show_status(read, read(), as_json=as_json, watch=watch, interval=interval)


@contextlib.contextmanager
def _direct_reader(config: DaemonConfig) -> Iterator[Callable[[], dict[str, Any]]]:
    """``peerd.daemon.swarm_reader`` on an event loop in a background thread, read synchronously.

    The main thread stays free for the (blocking) display loop and for Ctrl-C, and the
    short-lived node is shut down on exit whatever happens there.
    """
    from peerd.daemon import swarm_reader

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="peerd-status", daemon=True)
    thread.start()

    def run(coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)

    try:
        context = swarm_reader(config)
        read = run(context.__aenter__(), timeout=300)
        try:
            yield lambda: run(read(), timeout=30)
        finally:
            run(context.__aexit__(None, None, None), timeout=30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()


# -- peerd leave / pause / resume ---------------------------------------------------------------------


@command("""
  peerd leave                       hand this peer's work over, announce OFFLINE, wait until the daemon exits
  peerd leave --grace-s 10          give the hand-over at most 10 s
  peerd leave --no-wait             ask the daemon to leave and return at once
  peerd leave --home /tmp/peer2     the daemon that uses another state directory
SIGTERM (e.g. `kill PID`, `systemctl stop`) leaves the same way, with --leave-grace-s.
""")
@click.option(
    "--grace-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds the daemon may spend handing its tasklets over; default: its --leave-grace-s.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    help="Wait until the daemon has exited (its control socket is closed), or return once it has agreed.",
)
@config_options(only=DAEMON)
def leave(grace_s: float | None, wait: bool, config_file: str | None, **overrides: Any) -> None:
    """Leave the swarm gracefully: hand this peer's training over to others, then stop the daemon.

    The daemon stops taking work, hands its tasklets (stage state, data position) to
    the peers that take them over, announces OFFLINE and exits, so the job loses no
    step. Exit code 3 when no daemon runs here, 1 when it is still running after its
    grace period and shutdown timeout.
    """
    daemon = client_of(load_config(config_file, overrides).resolved())
    params = {} if grace_s is None else {"grace_s": grace_s}
    reply = call(daemon, "leave", **params)
    click.echo(f"peer {reply['name']} is leaving: handing its work over for at most {reply['grace_s']:.0f} s")
    if not wait:
        return
    limit = reply["grace_s"] + reply["shutdown_timeout_s"] + LEAVE_SLACK_S
    deadline = time.monotonic() + limit
    while daemon.available():
        if time.monotonic() > deadline:
            raise CliError(f"the daemon is still running {limit:.0f} s after it agreed to leave; see its log")
        time.sleep(0.2)
    click.echo(f"peer {reply['name']} left the swarm")


@command("""
  peerd pause                       stop training here (e.g. to use the GPU yourself); the peer stays in the swarm
  peerd pause --reason "gaming"     the reason `peerd status` shows
  peerd resume                      take work again
""")
@click.option(
    "--reason", help="Why, in a few words (`peerd status` shows it); default: 'paused by its volunteer'."
)
@config_options(only=DAEMON)
def pause(reason: str | None, config_file: str | None, **overrides: Any) -> None:
    """Stop training on this peer until `peerd resume`, without leaving the swarm.

    Training here stops and the peer takes no new work; the daemon keeps running,
    answering and measuring links, so `peerd resume` brings it back at once. Exit code
    3 when no daemon runs here.
    """
    daemon = client_of(load_config(config_file, overrides).resolved())
    reply = call(daemon, "pause", **({"reason": reason} if reason else {}))
    click.echo(f"paused ({reply['reason']}); `peerd resume` takes work again")


@command("""
  peerd resume                      after `peerd pause`: take work again
  peerd resume --home /tmp/peer2    the daemon that uses another state directory
""")
@config_options(only=DAEMON)
def resume(config_file: str | None, **overrides: Any) -> None:
    """Take work again after `peerd pause`: the peer can be planned into jobs from their next re-plan.

    Exit code 3 when no daemon runs here.
    """
    daemon = client_of(load_config(config_file, overrides).resolved())
    reply = call(daemon, "resume")
    click.echo("resumed: this peer takes work again" if reply["was_paused"] else "this peer was not paused")
