"""``peerd bench wan``'s host CPU accounting: a session's CPU seconds from /proc, and the regime it implies."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from peerd.bench.wan import HOST_BOUND_SHARE, arm_spec, arms, host_cpu, machine_busy_seconds, regime
from peerd.localswarm import sessions_cpu_by_role, sessions_cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def _read_until(read, done, seconds: float = 20.0):
    """``read()`` every 0.1 s until ``done`` holds for what it returned, or ``seconds`` have passed; the last reading."""
    deadline = time.monotonic() + seconds
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


@contextlib.contextmanager
def _session(script: str) -> Iterator[subprocess.Popen]:
    """A session leader running ``script``; the whole session is killed on exit."""
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        yield leader
    finally:
        subprocess.run(["pkill", "-9", "-s", str(leader.pid)], check=False)
        leader.wait()


def test_a_session_counts_its_live_processes_and_the_children_they_reaped() -> None:
    # a session leader that runs a CPU-bound child to the end (reaped: in the leader's cutime), then burns itself
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.4)!r}])\n"
        + BURN.format(s=0.3)
        + "time.sleep(30)\n"
    )
    with _session(script) as leader:
        used = _read_until(lambda: sessions_cpu_seconds([leader.pid]) or 0.0, lambda u: u >= 0.7)
        assert 0.7 <= used < 3.0  # the child's 0.4 s, the leader's 0.3 s, and the interpreters' start-up
        assert sessions_cpu_seconds([]) == 0.0
        assert sessions_cpu_seconds([leader.pid + 10_000_000]) == 0.0  # no such session


def test_a_sessions_cpu_splits_into_the_daemon_its_dht_process_and_the_rest() -> None:
    # a leader (the daemon) that starts a child leading its own process group (the DHT process) and
    # a plain child (a worker); each burns a different amount, then sleeps
    group = "import os\nos.setpgid(0, 0)\n" + BURN.format(s=0.5) + "import time\ntime.sleep(30)\n"
    plain = BURN.format(s=0.25) + "import time\ntime.sleep(30)\n"
    script = (
        "import subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {group!r}]), subprocess.Popen([sys.executable, '-c', {plain!r}])]\n"
        + BURN.format(s=0.1)
        + "time.sleep(30)\n"
    )
    with _session(script) as leader:
        roles = _read_until(
            lambda: sessions_cpu_by_role([leader.pid]) or {},
            lambda r: r.get("dht", 0) >= 0.5 and r.get("other", 0) >= 0.25 and r.get("daemon", 0) >= 0.1,
        )
        assert set(roles) == {"daemon", "dht", "p2pd", "other"}
        assert 0.5 <= roles["dht"] < 1.5 and 0.25 <= roles["other"] < 1.25 and 0.1 <= roles["daemon"] < 1.1
        assert roles["p2pd"] == 0.0
        assert sum(roles.values()) == pytest.approx(sessions_cpu_seconds([leader.pid]), abs=0.05)


def test_the_machine_busy_counter_grows_with_work() -> None:
    before = machine_busy_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = machine_busy_seconds()
    assert before is not None and after is not None and after - before >= 0.15


def test_a_swarm_that_keeps_the_cores_busy_is_host_bound() -> None:
    steady = [(10.0, 2), (20.0, 7)]  # 5 steps in 10 s
    roles0 = {"daemon": 50.0, "dht": 20.0, "p2pd": 30.0, "other": 0.0}
    roles1 = {"daemon": 60.0, "dht": 23.0, "p2pd": 35.0, "other": 0.0}
    busy = host_cpu({2: (100.0, 150.0, roles0), 7: (118.0, 169.0, roles1)}, steady, cores=2)
    assert busy is not None
    assert busy["swarm_cpu_s_per_step"] == pytest.approx(18 / 5)
    assert busy["swarm_cpu_s_per_step_by_role"] == pytest.approx(
        {"daemon": 2.0, "dht": 0.6, "p2pd": 1.0, "other": 0.0}
    )
    assert busy["swarm_share_of_cores"] == pytest.approx(0.9) and busy[
        "machine_share_of_cores"
    ] == pytest.approx(0.95)
    assert busy["regime"].startswith("host-CPU-bound") and busy["over_steps"] == [2, 7]
    idle = host_cpu({2: (100.0, 150.0, None), 7: (105.0, 160.0, None)}, steady, cores=2)
    assert idle is not None and idle["swarm_share_of_cores"] < HOST_BOUND_SHARE
    assert idle["regime"].startswith("link- or wait-bound") and idle["swarm_cpu_s_per_step_by_role"] is None
    assert host_cpu({2: (None, None, None), 7: (1.0, 1.0, None)}, steady, cores=2) is None  # no /proc
    assert host_cpu({}, steady[:1], cores=2) is None


def test_the_link_scale_multiplies_the_matched_bandwidth_factor() -> None:
    spec = arm_spec(arms(1)[1], 8, 20)
    matched, slower = regime(spec, 8, 0.14, 2), regime(spec, 8, 0.14, 2, link_scale=0.25)
    assert slower["bandwidth_factor"] == pytest.approx(matched["bandwidth_factor"] * 0.25)
    assert slower["delay_factor"] == matched["delay_factor"] and slower["link_scale"] == 0.25
    assert "x link scale 0.25" in slower["arithmetic"] and "link scale" not in matched["arithmetic"]
