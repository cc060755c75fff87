"""Launch a swarm of ``peerd join`` daemons on loopback as subprocesses: start, wait until ready, stop, always reap.

Used by the integration tests, ``peerd demo``, the benchmarks and (later) the
training launcher. Peer 0 starts a new swarm; the others join it. Each daemon
gets its own state directory (identity, control socket, ``peerd.yaml``,
``daemon.log``) and runs in its own session, so the launcher can find and reap
everything it started (the daemon, its DHT process and p2pd) even after a
SIGKILL. Readiness is the ``PEERD_READY`` line the daemon prints once it is
ONLINE; there are no fixed sleeps. While a swarm runs, a SIGTERM to the launching
process unwinds it like Ctrl-C, so its ``close`` still reaps the daemons.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from peerd.config import DaemonConfig
from peerd.control import ControlClient
from peerd.daemon import ReadyInfo, parse_ready_line
from peerd.errors import ErrorCode, PeerdError, PeerUnavailable
from peerd.loading import from_mapping, to_mapping
from peerd.log import get_logger

logger = get_logger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
POLL_S = 0.1  # granularity of waits on child processes (an event wait, not a sleep-and-hope)
LOG_TAIL_LINES = 25


@dataclass
class LocalPeer:
    """One daemon of a ``LocalSwarm``."""

    index: int
    name: str
    home: Path
    options: dict[str, Any]
    process: subprocess.Popen | None = None
    info: ReadyInfo | None = None
    stdout_lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    @property
    def config_path(self) -> Path:
        return self.home / "peerd.yaml"

    @property
    def log_path(self) -> Path:
        return self.home / "daemon.log"

    @property
    def control_socket(self) -> Path:
        return self.home / "control.sock"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def control(self, timeout: float = 20.0) -> ControlClient:
        return ControlClient(self.control_socket, timeout=timeout)

    def status(self, timeout: float = 20.0) -> dict[str, Any]:
        """The daemon's ``status`` view (through its control socket)."""
        return self.control(timeout).call("status")

    def stacks(self, timeout: float = 5.0) -> str:
        """The stacks of the daemon's tasks and threads (SIGUSR1 makes it log them): why it seems stuck."""
        if not self.alive:
            return "(not running)"
        before = self.log_path.stat().st_size if self.log_path.exists() else 0
        assert self.process is not None
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), self.log_path.open("rb") as log:
                log.seek(before)
                text = log.read().decode(errors="replace")
                if "SIGUSR1" in text and "threads\n" in text:
                    return text[text.index("SIGUSR1") :]
            time.sleep(0.2)
        return f"(no stacks logged within {timeout:.0f} s)"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class LocalSwarm:
    """``with LocalSwarm(3, tmpdir) as swarm:`` starts three daemons and reaps them on exit.

    ``options`` go into every daemon's config (e.g. ``record_ttl``, ``profile_cache``);
    ``peer_options[i]`` into peer ``i``'s only. Loopback addresses, names, homes and the
    initial peer are filled in here.
    """

    def __init__(
        self,
        size: int,
        root: str | Path,
        *,
        options: dict[str, Any] | None = None,
        peer_options: list[dict[str, Any]] | None = None,
        names: list[str] | None = None,
        ready_timeout: float = 120.0,
        grace_s: float = 15.0,
        log_level: str = "INFO",
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        if size < 1:
            raise ValueError("a local swarm needs at least one peer")
        names = names or [f"peer{i}" for i in range(size)]
        if len(names) != size:
            raise ValueError(f"{len(names)} names for {size} peers")
        self.root = Path(root).absolute()
        self.options = dict(options or {})
        self.ready_timeout = ready_timeout
        self.grace_s = grace_s
        self.log_level = log_level
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.python = python
        self._trapped = False  # holds the SIGTERM trap (``_trap_sigterm``) from start to close
        extra = peer_options or [{} for _ in range(size)]
        self.peers = [
            LocalPeer(index=i, name=names[i], home=self.root / names[i], options={**self.options, **extra[i]})
            for i in range(size)
        ]

    # -- starting -------------------------------------------------------------------------------

    def start(self) -> LocalSwarm:
        """Start peer 0, wait until it is ready, then start the others together and wait for them."""
        if not self._trapped:
            self._trapped = _trap_sigterm()
        try:
            self._launch(self.peers[0], initial_peers=[])
            self._wait_ready([self.peers[0]])
            bootstrap = self.bootstrap_maddrs
            for peer in self.peers[1:]:
                self._launch(peer, initial_peers=bootstrap)
            self._wait_ready(self.peers[1:])
        except BaseException:
            self.close()
            raise
        return self

    def add_peer(
        self,
        name: str | None = None,
        *,
        initial_peers: list[str] | None = None,
        options: dict[str, Any] | None = None,
    ) -> LocalPeer:
        """Start one more daemon and wait until it is ready; it joins through ``initial_peers``
        (default: the addresses of the first running peer)."""
        index = len(self.peers)
        name = name or f"peer{index}"
        if any(p.name == name for p in self.peers):
            raise ValueError(f"the local swarm already has a peer named {name!r}")
        peer = LocalPeer(
            index=index, name=name, home=self.root / name, options={**self.options, **(options or {})}
        )
        self.peers.append(peer)
        self._launch(peer, initial_peers=self.bootstrap_maddrs if initial_peers is None else initial_peers)
        self._wait_ready([peer])
        return peer

    def restart_peer(self, peer: LocalPeer | int, *, initial_peers: list[str] | None = None) -> LocalPeer:
        """Start a stopped peer again in its home (same identity, same remembered peers) and wait until it
        is ready; ``initial_peers`` default: none, so it rejoins through the peers it remembers."""
        peer = self.peers[peer] if isinstance(peer, int) else peer
        if peer.alive:
            raise ValueError(f"{peer.name} is still running; stop it first")
        self._launch(peer, initial_peers=list(initial_peers or []))
        self._wait_ready([peer])
        return peer

    @property
    def bootstrap_maddrs(self) -> list[str]:
        """Where new peers join: the multiaddrs of the first ready peer."""
        for peer in self.peers:
            if peer.info is not None and peer.alive:
                return list(peer.info.maddrs)
        raise PeerUnavailable("no peer of the local swarm is running")

    def config_for(self, peer: LocalPeer, initial_peers: list[str]) -> DaemonConfig:
        # every daemon here shares this machine's cores: one compute thread each unless told otherwise
        mapping = {"host_maddrs": [LOOPBACK], "threads": 1, **peer.options}
        mapping.update(name=peer.name, home=str(peer.home), initial_peers=list(initial_peers))
        mapping = {k: str(v) if isinstance(v, Path) else v for k, v in mapping.items()}
        return from_mapping(DaemonConfig, mapping)  # invalid options fail here, before any process starts

    def _launch(self, peer: LocalPeer, initial_peers: list[str]) -> None:
        config = self.config_for(peer, initial_peers)
        peer.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = {k: v for k, v in to_mapping(config).items() if v is not None}
        data = {k: str(v) if isinstance(v, Path) else v for k, v in data.items()}
        peer.config_path.write_text(yaml.safe_dump(data, sort_keys=True))
        cmd = [
            self.python,
            "-c",
            "from peerd.cli import main; main()",
            "--log-level",
            self.log_level,
            "join",
            "--config",
            str(peer.config_path),
        ]
        with open(peer.log_path, "ab") as log:
            peer.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                start_new_session=True,  # own session: terminal signals stay with us; reaping finds all of it
                text=True,
                bufsize=1,
            )
        peer.info = None
        peer.stdout_lines = []
        peer._ready = threading.Event()
        peer._reader = threading.Thread(
            target=_read_stdout, args=(peer,), name=f"stdout-{peer.name}", daemon=True
        )
        peer._reader.start()
        logger.info("started %s (pid %d, home %s)", peer.name, peer.process.pid, peer.home)

    def _wait_ready(self, peers: Iterable[LocalPeer]) -> None:
        pending = list(peers)
        deadline = time.monotonic() + self.ready_timeout
        while pending:
            for peer in list(pending):
                if peer._ready.is_set():
                    pending.remove(peer)
                    logger.info("%s ready: %s", peer.name, peer.info.peer_id if peer.info else "?")
                elif not peer.alive:
                    code = peer.process.returncode if peer.process else None
                    raise PeerUnavailable(
                        f"{peer.name} exited with code {code} before it was ready; its log ends with:\n"
                        f"{peer.log_tail()}"
                    )
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise PeerUnavailable(
                    f"{names} not ready within {self.ready_timeout:.0f} s; {pending[0].name}'s log ends with:\n"
                    f"{pending[0].log_tail()}",
                    code=ErrorCode.TIMEOUT,
                )
            pending[0]._ready.wait(POLL_S)

    # -- observing ------------------------------------------------------------------------------

    def live_peers(self) -> list[LocalPeer]:
        return [p for p in self.peers if p.alive and p.info is not None]

    def statuses(self) -> dict[str, dict[str, Any]]:
        """name -> status view, for every running peer that answers."""
        out = {}
        for peer in self.live_peers():
            with contextlib.suppress(PeerdError):
                out[peer.name] = peer.status()
        return out

    def wait_until(
        self,
        predicate: Callable[[dict[str, dict[str, Any]]], bool],
        timeout: float,
        *,
        what: str = "the swarm to converge",
        interval: float = 0.5,
    ) -> dict[str, dict[str, Any]]:
        """Poll ``statuses()`` until ``predicate`` holds; raises ``PeerdError(TIMEOUT)`` describing the last view."""
        deadline = time.monotonic() + timeout
        while True:
            views = self.statuses()
            if predicate(views):
                return views
            if time.monotonic() > deadline:
                raise PeerdError(
                    f"timed out after {timeout:.0f} s waiting for {what}; last view:\n{describe(views)}",
                    code=ErrorCode.TIMEOUT,
                )
            time.sleep(interval)

    # -- stopping -------------------------------------------------------------------------------

    def stop_peer(
        self, peer: LocalPeer | int, timeout: float | None = None, *, sig: signal.Signals = signal.SIGTERM
    ) -> int | None:
        """SIGTERM (a leave: the daemon hands its work over, announces OFFLINE), SIGKILL after the grace period;
        returns the exit code."""
        peer = self.peers[peer] if isinstance(peer, int) else peer
        if peer.process is None:
            return None
        if peer.alive:
            with contextlib.suppress(ProcessLookupError):
                peer.process.send_signal(sig)
        return self._reap(peer, self.grace_s if timeout is None else timeout)

    def kill_peer(self, peer: LocalPeer | int) -> int | None:
        """SIGKILL the daemon process only, like a crash: its record stays until its TTL runs out."""
        peer = self.peers[peer] if isinstance(peer, int) else peer
        if peer.process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            peer.process.send_signal(signal.SIGKILL)
        return self._reap(peer, 0.0)

    def close(self) -> None:
        """Stop every peer at once, SIGKILL what is left after the grace period, and reap everything.

        The whole swarm goes, so there is nobody to hand work over to: each daemon gets the
        control ``shutdown`` (OFFLINE, then exit), not the leave that SIGTERM starts; SIGTERM
        only where the control socket does not answer.
        """
        started = [p for p in self.peers if p.process is not None]
        for peer in started:
            if not peer.alive:
                continue
            try:
                peer.control(timeout=5.0).call("shutdown")
            except PeerdError:
                with contextlib.suppress(ProcessLookupError):
                    peer.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + self.grace_s
        for peer in started:
            self._reap(peer, max(0.0, deadline - time.monotonic()))
        if self._trapped:
            self._trapped = False
            _release_sigterm()

    def _reap(self, peer: LocalPeer, grace: float) -> int | None:
        process = peer.process
        assert process is not None
        try:
            code = process.wait(timeout=grace) if grace > 0 else process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            logger.warning("%s did not exit within %.0f s; killing it", peer.name, grace)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            code = process.wait()
        _reap_session(process.pid)
        if peer._reader is not None:
            peer._reader.join(timeout=2.0)
        return code

    def cpu_seconds_by_role(self) -> dict[str, float] | None:
        """CPU seconds the live daemons' sessions used so far, by the role of each process (daemon,
        DHT process, p2pd, other: ``sessions_cpu_by_role``)."""
        return sessions_cpu_by_role(p.pid for p in self.live_peers() if p.pid is not None)

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


_sigterm_traps = 0  # live swarms that asked for the trap
_sigterm_before: Any = None  # the handler the first of them replaced


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _trap_sigterm() -> bool:
    """Make a SIGTERM to this process (``kill``, a CI runner's timeout) unwind like Ctrl-C, so the
    ``close`` in a ``finally`` or ``with`` reaps the daemons instead of leaving them running.

    Only from the main thread, and only over the default handler (a program with its own keeps
    it); True when this swarm holds the trap.
    """
    global _sigterm_traps, _sigterm_before
    if threading.current_thread() is not threading.main_thread():
        return False
    if _sigterm_traps == 0:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        _sigterm_before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _sigterm_traps += 1
    return True


def _release_sigterm() -> None:
    global _sigterm_traps
    _sigterm_traps -= 1
    if _sigterm_traps == 0 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm_before)


def _read_stdout(peer: LocalPeer) -> None:
    """Collect a daemon's stdout (drained to the end, so it never blocks on a full pipe); flag its ready line."""
    assert peer.process is not None and peer.process.stdout is not None
    for line in peer.process.stdout:
        line = line.rstrip("\n")
        peer.stdout_lines.append(line)
        info = parse_ready_line(line)
        if info is not None:
            peer.info = info
            peer._ready.set()
    peer.process.stdout.close()


def _process_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after its command name) of every process (Linux; none elsewhere)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()  # after "(comm)", which may contain spaces
            if len(fields) > 14:
                yield int(entry.name), fields


def _session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid`` (Linux /proc); empty where /proc is missing."""
    return [pid for pid, f in _process_stats() if f[0] != "Z" and int(f[3]) == sid]


def sessions_cpu_seconds(sids: Iterable[int]) -> float | None:
    """CPU seconds (user + system) the processes of sessions ``sids`` used so far, with the children they
    reaped (zombies too); None where /proc is missing. A child whose parent died before it (reaped by
    init) takes its seconds out of the count."""
    roles = sessions_cpu_by_role(sids)
    return None if roles is None else sum(roles.values())


CPU_ROLES = ("daemon", "dht", "p2pd", "other")


def sessions_cpu_by_role(sids: Iterable[int]) -> dict[str, float] | None:
    """``sessions_cpu_seconds`` split by what each process is: the daemon (the session's leader),
    its DHT process (which leads a process group of its own), the p2pd daemons, anything else
    (tasklet workers, torch's helpers). None where /proc is missing."""
    wanted = set(sids)
    if not os.path.isdir("/proc"):
        return None
    ticks = dict.fromkeys(CPU_ROLES, 0)
    for pid, f in _process_stats():
        if int(f[3]) not in wanted:
            continue
        if pid == int(f[3]):
            role = "daemon"
        elif _command_name(pid) == "p2pd":
            role = "p2pd"
        else:
            role = "dht" if pid == int(f[2]) else "other"
        ticks[role] += sum(int(x) for x in f[11:15])  # utime, stime, cutime, cstime
    return {role: n / os.sysconf("SC_CLK_TCK") for role, n in ticks.items()}


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _reap_session(sid: int, grace: float = 3.0) -> None:
    """Wait for the rest of a daemon's session (DHT process, p2pd) to go, then SIGKILL what remains."""
    deadline = time.monotonic() + grace
    members = _session_members(sid)
    while members and time.monotonic() < deadline:
        time.sleep(POLL_S)
        members = _session_members(sid)
    for pid in members:
        logger.warning("killing leftover process %d of session %d", pid, sid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)  # non-Linux fallback: at least the daemon's own process group


# -- convergence ------------------------------------------------------------------------------------


def converged(views: dict[str, dict[str, Any]], expected: Iterable[str], *, links: bool = True) -> bool:
    """Every peer in ``expected`` answers and sees all of ``expected`` ONLINE with a measured profile,
    and (with ``links``) a successful link measurement for every ordered pair among them."""
    names = set(expected)
    if set(views) < names:
        return False
    for name in names:
        rows = {p["name"]: p for p in views[name].get("peers", [])}
        if not names <= set(rows):
            return False
        if any(rows[n]["state"] != "online" or (rows[n]["tflops"] or {}).get("fp32", 0) <= 0 for n in names):
            return False
        if links:
            ids = {rows[n]["peer_id"] for n in names}
            ok = {(x["src"], x["dst"]) for x in views[name].get("links", []) if x["status"] == "ok"}
            if any((a, b) not in ok for a in ids for b in ids if a != b):
                return False
    return True


def describe(views: dict[str, dict[str, Any]]) -> str:
    """One line per observer: who it sees, in which state, and how many link measurements."""
    lines = []
    for name, view in sorted(views.items()):
        seen = ", ".join(f"{p['name']}={p['state']}" for p in view.get("peers", []))
        ok = sum(1 for link in view.get("links", []) if link["status"] == "ok")
        lines.append(f"  {name} sees [{seen}], {ok} ok links")
    return "\n".join(lines) or "  (no peer answered)"
