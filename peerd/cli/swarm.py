"""``peerd join`` and ``peerd status``: run a peer, and show who is in the swarm (peers table + link matrix).

The flags of both commands are generated from ``peerd.config.DaemonConfig``
fields, so an option and its help text are declared once, in the config.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from peerd.cli import EXIT_FAILED, EXIT_STARTUP
from peerd.config import DaemonConfig, OptionSpec, load_config, option_specs
from peerd.errors import PeerdError, PeerUnavailable

STATE_STYLE = {"online": "green", "joining": "yellow", "offline": "red"}


class StartupFailure(click.ClickException):
    """The daemon or the swarm could not be reached or started (exit code 3)."""

    exit_code = EXIT_STARTUP


class OperationFailed(click.ClickException):
    exit_code = EXIT_FAILED


# -- flags generated from DaemonConfig ----------------------------------------------------------------


def _click_option(spec: OptionSpec) -> Callable[[Callable], Callable]:
    help_text = spec.doc
    if spec.default not in (None, "", []):
        shown = " ".join(spec.default) if isinstance(spec.default, list) else spec.default
        help_text += f"  [default: {shown}]"
    kwargs: dict[str, Any] = {"default": None, "help": help_text, "metavar": spec.metavar}
    if spec.kind == "list":
        kwargs.update(multiple=True, default=())
    elif spec.kind == "int":
        kwargs["type"] = int
    elif spec.kind == "float":
        kwargs["type"] = float
    elif spec.kind == "path":
        kwargs["type"] = click.Path(dir_okay=spec.name in ("home",), file_okay=spec.name != "home")
    return click.option(spec.flag, spec.name, **kwargs)


def config_options(only: tuple[str, ...] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a command with ``--config FILE`` plus one flag per DaemonConfig field (or just ``only``)."""
    specs = [s for s in option_specs(DaemonConfig) if only is None or s.name in only]

    def decorate(fn: Callable) -> Callable:
        for spec in reversed(specs):
            fn = _click_option(spec)(fn)
        return click.option(
            "--config",
            "config_file",
            type=click.Path(exists=True, dir_okay=False),
            help="YAML or JSON file with any of these options (keys = flag names with _); flags override it.",
        )(fn)

    return decorate


# -- peerd join ---------------------------------------------------------------------------------------


@click.command(
    epilog="""\b
Examples:
  peerd join                                   start a new swarm; prints the address others join with
  peerd join --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/QmX...   join a running swarm
  peerd join --host-maddrs /ip4/0.0.0.0/tcp/31337 --announce-maddrs /ip4/203.0.113.7/tcp/31337
  peerd join --config peer.yaml --device cuda:1
Stop with Ctrl-C or SIGTERM: the peer announces OFFLINE and exits;
a second Ctrl-C skips the grace period."""
)
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

    try:
        run_daemon(config, on_ready)
    except PeerUnavailable as exc:
        raise StartupFailure(str(exc)) from None


# -- peerd status -------------------------------------------------------------------------------------


@click.command(
    epilog="""\b
Examples:
  peerd status                      the swarm as your local daemon sees it
  peerd status --watch              refresh in place every 2 s (Ctrl-C to quit)
  peerd status --json | jq '.peers[] | {name, state, tflops}'
  peerd status --initial-peers /ip4/10.0.0.5/tcp/31337/p2p/QmX...   no local daemon needed
  peerd status --home /tmp/peer2    the daemon that uses another state directory"""
)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (one document per refresh).")
@click.option("--watch", is_flag=True, help="Keep refreshing in place until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
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
    from peerd.control import ControlClient, DaemonNotRunning

    client = ControlClient(config.control_socket, timeout=20.0)  # type: ignore[arg-type]
    if not direct:
        try:
            first = client.call("status")
        except DaemonNotRunning as exc:
            if not config.initial_peers:
                raise StartupFailure(
                    f"{exc}.\nStart one with `peerd join`, point --home at its state directory, "
                    "or pass --initial-peers MADDR to read the swarm directly."
                ) from None
        except PeerdError as exc:
            raise OperationFailed(f"the local daemon did not answer: {exc}") from None
        else:
            _show(lambda: client.call("status"), first, as_json=as_json, watch=watch, interval=interval)
            return
    _status_direct(config, as_json=as_json, watch=watch, interval=interval)


def _status_direct(config: DaemonConfig, *, as_json: bool, watch: bool, interval: float) -> None:
    try:
        with _DirectReader(config) as reader:
            _show(reader.read, reader.read(), as_json=as_json, watch=watch, interval=interval)
    except PeerUnavailable as exc:
        raise StartupFailure(str(exc)) from None
    except PeerdError as exc:
        raise OperationFailed(str(exc)) from None


class _DirectReader:
    """``peerd.daemon.swarm_reader`` on an event loop in a background thread, read synchronously.

    The main thread stays free for the (blocking) display loop and for Ctrl-C, and the
    short-lived node is shut down on exit whatever happens there.
    """

    def __init__(self, config: DaemonConfig) -> None:
        from peerd.daemon import swarm_reader

        self._context = swarm_reader(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="peerd-status", daemon=True)
        self._read: Callable[[], Any] | None = None

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def __enter__(self) -> _DirectReader:
        self._thread.start()
        try:
            self._read = self._run(self._context.__aenter__(), timeout=300)
        except BaseException:
            self._stop_loop()
            raise
        return self

    def read(self) -> dict[str, Any]:
        assert self._read is not None
        return self._run(self._read(), timeout=30)

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._run(self._context.__aexit__(None, None, None), timeout=30)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


def _show(
    read: Callable[[], dict[str, Any]], first: dict[str, Any], *, as_json: bool, watch: bool, interval: float
) -> None:
    try:
        if as_json:
            click.echo(json.dumps(first, sort_keys=True))
            while watch:
                time.sleep(interval)
                click.echo(json.dumps(_read_or_error(read), sort_keys=True))
            return
        console = Console()
        if not watch:
            console.print(render_status(first))
            return
        from rich.live import Live

        with Live(render_status(first), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render_status(_read_or_error(read)))
    except KeyboardInterrupt:  # the way to leave --watch
        pass


def _read_or_error(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return read()
    except (PeerdError, TimeoutError) as exc:
        return {"error": str(exc), "peers": [], "links": []}


# -- rendering ----------------------------------------------------------------------------------------


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _tflops(tflops: dict[str, float]) -> str:
    """fp32, then the fastest half-precision dtype: "0.076/0.42"."""
    if not tflops:
        return "-"
    fp32 = f"{tflops['fp32']:.2g}" if "fp32" in tflops else "-"
    half = [tflops[k] for k in ("bf16", "fp16") if k in tflops]
    return f"{fp32}/{max(half):.2g}" if half else fp32


def peers_table(view: dict[str, Any]) -> Table:
    table = Table(
        title="peers",
        title_justify="left",
        caption="* this peer · TFLOPS: fp32/16-bit · mem: free/total GiB",
        caption_justify="left",
    )
    table.add_column("id", no_wrap=True, min_width=8)
    table.add_column("name", no_wrap=True)
    table.add_column("device", overflow="ellipsis", no_wrap=True, max_width=28)
    table.add_column("TFLOPS", justify="right", no_wrap=True)
    table.add_column("mem", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True, min_width=7)
    table.add_column("seen", justify="right", no_wrap=True)
    for peer in view.get("peers", []):
        state = peer["state"]
        table.add_row(
            peer["short_id"],
            peer["name"] + ("*" if peer.get("self") else ""),
            peer.get("device") or "-",
            _tflops(peer.get("tflops") or {}),
            f"{_gib(peer.get('memory_free_bytes'))}/{_gib(peer.get('memory_total_bytes'))}",
            Text(state.upper(), style=STATE_STYLE.get(state, "")),
            _ago(peer.get("last_seen_s")),
        )
    return table


def link_cells(view: dict[str, Any]) -> dict[tuple[str, str], str]:
    """Matrix cell text per (src, dst) peer id: "RTT ms / Mbit/s" src -> dst, or the probe's failure."""
    cells: dict[tuple[str, str], str] = {}
    for link in view.get("links", []):
        src, dst = link["src"], link["dst"]
        if link["status"] != "ok":
            cells.setdefault((src, dst), link["status"])
            continue
        rtt, up, down = link.get("rtt_ms"), link.get("bw_up_mbps"), link.get("bw_down_mbps")
        cells[(src, dst)] = _cell(rtt, up)
        if (dst, src) not in cells and down is not None:  # the reverse direction, measured from this side
            cells[(dst, src)] = _cell(rtt, down)
    return cells


def _cell(rtt_ms: float | None, mbps: float | None) -> str:
    rtt = "-" if rtt_ms is None else f"{rtt_ms:.1f}"
    bw = "-" if mbps is None else f"{mbps:.0f}"
    return f"{rtt} / {bw}"


def links_table(view: dict[str, Any]) -> Table:
    peers = [p for p in view.get("peers", []) if p["state"] != "offline"]
    table = Table(title="links: RTT ms / Mbit/s, row -> column", title_justify="left")
    table.add_column("from \\ to", no_wrap=True)
    for peer in peers:
        table.add_column(peer["name"], justify="right", no_wrap=True)
    cells = link_cells(view)
    for src in peers:
        row = []
        for dst in peers:
            row.append("·" if src is dst else cells.get((src["peer_id"], dst["peer_id"]), "?"))
        table.add_row(src["name"], *row)
    return table


def render_status(view: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = []
    if "error" in view:
        parts.append(Text(f"error: {view['error']}", style="red"))
    me = view.get("self")
    if me:
        parts.append(Text(f"this peer: {me['name']}, {me['state'].upper()} in swarm {me['swarm']!r}"))
        parts.append(Text(f"peer id:   {me['peer_id']}"))
    if view.get("stale"):
        parts.append(Text("the DHT did not answer; showing the last known table", style="yellow"))
    parts.append(peers_table(view))
    if len([p for p in view.get("peers", []) if p["state"] != "offline"]) > 1:
        parts.append(links_table(view))
    from peerd.cli.jobs import render_jobs  # jobs, allocations as pipelines, loss sparklines

    jobs = render_jobs(view)
    if jobs is not None:
        parts.append(jobs)
    return Group(*parts)
