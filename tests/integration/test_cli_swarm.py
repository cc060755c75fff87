"""The swarm CLI through the real ``peerd`` entry point: expected failures give a message and an exit code, never a traceback."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from peerd.cli import cli
from peerd.control import ControlError
from peerd.localswarm import converged

pytestmark = pytest.mark.integration

# A well-formed peer id nobody runs, on a loopback port nobody listens on.
NOBODY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEERD = [sys.executable, "-c", "from peerd.cli import main; main()"]


def _dead_maddr() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{NOBODY}"


def _no_traceback(result) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def test_status_without_a_daemon_says_how_to_start_one(peerd_cli, tmp_path):
    result = peerd_cli("status", "--home", str(tmp_path / "nobody-home"))
    assert result.returncode == 3
    assert "no peerd daemon is running" in result.stderr
    assert "peerd join" in result.stderr and "--initial-peers" in result.stderr
    _no_traceback(result)


def test_status_with_an_unreachable_bootstrap_fails_fast_and_clean(peerd_cli, tmp_path):
    result = peerd_cli("status", "--home", str(tmp_path), "--initial-peers", _dead_maddr(), timeout=60)
    assert result.returncode == 3
    assert "none of the initial peers answered" in result.stderr
    _no_traceback(result)


def test_bad_addresses_are_usage_errors(peerd_cli, tmp_path):
    result = peerd_cli("status", "--home", str(tmp_path), "--initial-peers", "not-an-address")
    assert result.returncode == 2
    assert "initial_peers[0]" in result.stderr
    _no_traceback(result)
    result = peerd_cli("join", "--home", str(tmp_path), "--record-ttl", "5", "--refresh-interval", "9")
    assert result.returncode == 2
    assert "refresh_interval" in result.stderr
    _no_traceback(result)


def test_join_with_an_unreachable_bootstrap_exits_3_and_leaves_nothing_behind(peerd_cli, tmp_path):
    home = tmp_path / "joiner"
    result = peerd_cli(
        "join",
        "--home",
        str(home),
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--initial-peers",
        _dead_maddr(),
        "--device",
        "cpu",
        timeout=90,
    )
    assert result.returncode == 3, result.stderr
    assert "none of the initial peers answered" in result.stderr
    _no_traceback(result)
    assert not (home / "control.sock").exists()  # the control endpoint was closed on the way out


def test_one_daemon_table_watch_and_home_lock(local_swarm, peerd_cli, wait_until):
    swarm = local_swarm(1)
    peer = swarm.peers[0]

    # the human table, through the local daemon
    result = peerd_cli("status", "--home", str(peer.home))
    assert result.returncode == 0, result.stderr
    assert "peer0*" in result.stdout and "ONLINE" in result.stdout and peer.info.peer_id[-8:] in result.stdout
    # the local swarm gives each daemon one compute thread, and the daemon applied it
    assert peer.status()["self"]["threads"] == 1 and "training uses 1 compute threads" in peer.log_tail(200)
    # its record says what a message and a codec call cost this machine (the cache's measurement)
    # and, once two refreshes apart without a job, the cores it keeps busy idle (DHT, p2pd, itself)
    row = peer.status()["peers"][0]
    assert row["message_us"] > 0 and row["wire_byte_ns"] > 0
    assert row["codec_us"] > 0 and row["codec_value_ns"] > 0
    idle = wait_until(lambda: peer.status()["peers"][0]["idle_cores"], 20, "the idle load in the record")
    assert 0 < idle < 2

    # off a terminal (click's runner is not one) no cell is cut, however narrow COLUMNS says it is
    narrow = CliRunner(env={"COLUMNS": "40"}).invoke(cli, ["status", "--home", str(peer.home)])
    assert narrow.exit_code == 0, narrow.output
    device = peer.status()["peers"][0]["device"]
    assert device in narrow.output and "…" not in narrow.output

    # --watch into a pipe: a whole new frame per refresh, not one frame redrawn in place
    frames = _watch_frames(peer.home, "--interval", "0.3")
    assert len(frames) == 3 and all("peer0*" in f and "ONLINE" in f for f in frames)

    # --watch --json: one document per refresh until Ctrl-C, which is a normal exit
    docs = [json.loads(line) for line in _watch_frames(peer.home, "--json", "--interval", "0.3")]
    assert all([p["name"] for p in doc["peers"]] == ["peer0"] for doc in docs)
    seqs = [doc["self"]["seq"] for doc in docs]
    assert seqs == sorted(seqs)

    # a second daemon on the same home is refused before it starts anything
    result = peerd_cli("join", "--config", str(peer.config_path), timeout=60)
    assert result.returncode == 2
    assert "already running with this home" in result.stderr
    _no_traceback(result)
    assert peer.status()["self"]["state"] == "online"  # the running one is undisturbed

    # fault injection is off unless the daemon's environment turns it on: refused, naming how
    with pytest.raises(ControlError, match="PEERD_FAULT_INJECTION=1"):
        peer.control().call("partition", peers=[peer.info.peer_id], seconds=5)

    # the control endpoint's shutdown: a graceful exit with code 0
    assert peer.control().call("shutdown") == {"stopping": True}
    assert peer.process.wait(timeout=30) == 0
    assert "announced OFFLINE" in peer.log_tail(40)
    assert not peer.control_socket.exists()


def test_pause_resume_and_leave_through_the_cli(local_swarm, peerd_cli):
    """The volunteer controls on a real daemon: pause and resume show in status; leave drains, then exits 0."""
    swarm = local_swarm(1, leave_grace_s=30.0)
    peer = swarm.peers[0]
    home = ("--home", str(peer.home))

    result = peerd_cli("pause", "--reason", "gaming", *home)
    assert result.returncode == 0 and "paused (gaming)" in result.stdout, result.stderr
    me = peer.status()["self"]
    assert (me["paused"], me["pause_reason"], me["leaving"]) == (True, "gaming", False)
    result = peerd_cli("resume", *home)
    assert result.returncode == 0 and "resumed" in result.stdout, result.stderr
    assert (peer.status()["self"]["paused"], peer.status()["self"]["pause_reason"]) == (False, None)
    result = peerd_cli("resume", *home)
    assert result.returncode == 0 and "was not paused" in result.stdout

    result = peerd_cli("leave", "--grace-s", "0", *home)
    assert (
        result.returncode == 2 and "--grace-s" in result.stderr
    )  # refused by the CLI: nothing reached the daemon
    result = peerd_cli("leave", "--grace-s", "5", *home, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "is leaving: handing its work over for at most 5 s" in result.stdout
    assert "peer0 left the swarm" in result.stdout  # --wait (the default) returns once the daemon is gone
    assert peer.process.wait(timeout=30) == 0
    log = peer.log_tail(60)
    assert "leaving: handing this peer's work over for at most 5 s" in log and "announced OFFLINE" in log
    assert "handed this peer's work over" in log
    for command in ("leave", "pause", "resume"):
        result = peerd_cli(command, *home)
        assert result.returncode == 3 and "no peerd daemon is running" in result.stderr
        _no_traceback(result)


def test_two_daemons_status_and_jobs_off_a_terminal(local_swarm):
    swarm = local_swarm(2)
    names = [p.name for p in swarm.peers]
    swarm.wait_until(lambda v: converged(v, names), timeout=90, what="both daemons to measure each other")
    home = str(swarm.peers[0].home)
    runner = CliRunner(env={"COLUMNS": "40"})  # not a terminal, and a narrow one if it were

    result = runner.invoke(cli, ["status", "--home", home])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert len(re.findall(r"\d+\.\d / \d+", result.output)) == 2  # peer0 -> peer1 and back, in full

    result = runner.invoke(cli, ["jobs", "--home", home])
    assert result.exit_code == 0 and "no jobs in this swarm yet" in result.output
    for prefix, message in (("ab", "too short"), ("abcdef", "no job 'abcdef' is known")):
        result = runner.invoke(cli, ["cancel", prefix, "--home", home])
        assert result.exit_code == 2 and message in result.output, result.output


def test_demo_runs_a_swarm_and_cleans_up(peerd_cli, tmp_path):
    root = tmp_path / "demo"
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # the demo uses the machine-wide profile cache
    result = peerd_cli(
        "demo", "--peers", "2", "--timeout", "90", "--dir", str(root), "--json", timeout=170, env=cache
    )
    assert result.returncode == 0, result.stderr[-3000:]
    view = json.loads(result.stdout)
    assert sorted(p["name"] for p in view["peers"]) == ["peer0", "peer1"]
    assert all(p["state"] == "online" and p["tflops"]["fp32"] > 0 for p in view["peers"])
    assert {x["status"] for x in view["links"]} == {"ok"} and len(view["links"]) == 2
    assert "shutting the swarm down" in result.stderr
    # stderr is a pipe: the job's progress is a line per change, not one redrawn line
    steps = [int(n) for n in re.findall(r"^\[ *\d+ s\] running step (\d+)/\d+ ", result.stderr, re.M)]
    assert len(set(steps)) >= 2 and steps == sorted(steps), result.stderr[-3000:]
    shown = re.findall(r"^\[ *\d+ s\] (\w+ (?:step|epoch) .*)$", result.stderr, re.M)  # every progress line
    assert all(a != b for a, b in itertools.pairwise(shown)), result.stderr[-3000:]  # printed when it changes
    assert view["demo"]["state"] == "done" and "loss plot" in result.stderr
    for name in ("peer0", "peer1"):
        log = (root / name / "daemon.log").read_text()
        assert "announced OFFLINE" in log, log[-2000:]
        assert not (root / name / "control.sock").exists()
    _no_traceback(result)
    assert _processes_mentioning(str(root)) == []  # no daemon, DHT process or p2pd of the demo survived


def test_a_terminated_demo_still_reaps_its_daemons(tmp_path, wait_until):
    # `kill` or a CI runner's timeout sends SIGTERM, which once ended the launcher at once and left
    # every daemon, DHT process and p2pd of its swarm running
    root = tmp_path / "demo"
    args = ["demo", "--no-job", "--peers", "2", "--timeout", "90", "--dir", str(root)]
    demo = subprocess.Popen(
        [sys.executable, "-c", "from peerd.cli import main; main()", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    try:
        wait_until(
            lambda: all((root / n / "control.sock").exists() for n in ("peer0", "peer1")), 120, "both daemons"
        )
        assert _processes_mentioning(str(root)), "the daemons should run before the SIGTERM"
        demo.send_signal(signal.SIGTERM)
        output, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "shutting the swarm down" in output
    assert _processes_mentioning(str(root)) == []  # no daemon, DHT process or p2pd survived the launcher


def _watch_frames(home, *args: str, count: int = 3) -> list[str]:
    """The first ``count`` refreshes of ``peerd status --watch`` into a pipe, then Ctrl-C (a normal exit).

    A JSON refresh is one line; a table refresh starts with its ``-- HH:MM:SS --`` line.
    """
    watch = subprocess.Popen(
        [*PEERD, "status", "--home", str(home), "--watch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as in a terminal: a suite run in the background (``cmd &``) ignores SIGINT, its children
        # inherit that, and Python then never turns Ctrl-C into KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    frames: list[str] = []
    try:
        while len(frames) <= count:
            line = watch.stdout.readline()
            assert line, "peerd status --watch stopped early"
            if "--json" in args or line.startswith("-- "):
                frames.append(line)
            elif frames:
                frames[-1] += line
        watch.send_signal(signal.SIGINT)
        _, stderr = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr
    return frames[:count]


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (daemons carry their config path, p2pd its key path)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat") as fh:
                zombie = fh.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            continue
        if text in cmdline and not zombie:
            found.append(cmdline)
    return found
