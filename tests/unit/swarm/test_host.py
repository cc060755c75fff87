"""What a process tree spends of this machine's cores: read from /proc, and the idle share a daemon declares."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.swarm.host import IdleLoad, children, cpu_seconds, tree_cpu_seconds

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\ntime.sleep(60)"


@needs_proc
def test_a_grandchilds_cpu_counts_in_the_tree_and_nowhere_else():
    # this process starts a child that starts a grandchild burning 0.5 s of CPU, then both wait
    code = f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.5)!r}])\ntime.sleep(60)"
    before = tree_cpu_seconds()
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            grandchildren = children(child.pid)
            if grandchildren and (cpu_seconds(next(iter(grandchildren))) or 0) >= 0.5:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the grandchild never burnt its CPU")
        assert child.pid in children()
        spent = tree_cpu_seconds() - before
        assert 0.5 <= spent < 5.0  # the burn, the interpreters' start-up, this test's own reading
        assert cpu_seconds(child.pid) < 0.5  # the child only waited
    finally:
        for pid in children(child.pid):
            subprocess.run(["kill", str(pid)], check=False)
        child.kill()
        child.wait()


def test_a_pid_that_does_not_exist_reads_none():
    assert cpu_seconds(2**22 + 12345) is None


class FakeCpu:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_idle_load_counts_only_spans_between_two_idle_samples():
    cpu = FakeCpu()
    load = IdleLoad(window_s=100.0, read=cpu)
    assert load.cores is None
    load.sample(0.0, working=False)
    cpu.seconds = 1.0
    load.sample(10.0, working=False)  # 1 CPU-s over 10 s idle
    assert load.cores == pytest.approx(0.1)
    cpu.seconds = 20.0
    load.sample(20.0, working=True)  # a span with work in it is not idle
    cpu.seconds = 25.0
    load.sample(30.0, working=False)  # starts a new span: the 5 CPU-s since the work are not counted
    assert load.cores == pytest.approx(0.1)
    cpu.seconds = 28.0
    load.sample(40.0, working=False)  # 3 CPU-s over 10 s
    assert load.cores == pytest.approx(0.1)  # the lower quartile of 0.1 and 0.3


def test_idle_load_forgets_spans_beyond_its_window():
    cpu = FakeCpu()
    load = IdleLoad(window_s=30.0, read=cpu)
    load.sample(0.0, working=False)
    for t in range(10, 110, 10):
        cpu.seconds += 5.0 if t <= 50 else 1.0  # busy at first (probes settling), then quiet
        load.sample(float(t), working=False)
    assert load.cores == pytest.approx(0.1)  # only the last 30 s


def test_a_burst_between_idle_samples_does_not_move_the_idle_load():
    cpu = FakeCpu()
    load = IdleLoad(window_s=100.0, read=cpu)
    load.sample(0.0, working=False)
    for t, used in ((2, 0.1), (4, 0.1), (6, 1.9), (8, 0.1), (10, 0.1)):  # a status poll at t = 6
        cpu.seconds += used
        load.sample(float(t), working=False)
    assert load.cores == pytest.approx(0.05)


def test_work_run_excluding_is_cut_out_of_the_idle_spans():
    cpu = FakeCpu()
    clock = FakeCpu()  # a settable clock
    load = IdleLoad(window_s=100.0, read=cpu, clock=clock)
    load.sample(0.0, working=False)
    cpu.seconds, clock.seconds = 0.5, 5.0
    with load.excluding(working=False):  # closes [0, 5]: 0.5 CPU-s
        cpu.seconds, clock.seconds = 4.5, 7.0  # a probe round: 4 CPU-s in 2 s
        load.sample(6.0, working=False)  # a record built meanwhile counts nothing
    cpu.seconds = 5.5
    load.sample(17.0, working=False)  # [7, 17]: 1 CPU-s
    assert load.cores == pytest.approx(0.1)  # both spans 0.1 cores; the round's 2 cores are gone


def test_nested_exclusions_reopen_the_span_once_the_last_ends():
    cpu, clock = FakeCpu(), FakeCpu()
    load = IdleLoad(window_s=100.0, read=cpu, clock=clock)
    load.sample(0.0, working=False)
    with load.excluding(working=False):
        with load.excluding(working=False):  # a probe answered during our own round
            cpu.seconds, clock.seconds = 3.0, 2.0
        cpu.seconds, clock.seconds = 6.0, 4.0
    cpu.seconds = 6.4
    load.sample(8.0, working=False)
    assert load.cores == pytest.approx(0.1)  # [4, 8] only; [0, 0] was too short to count


def test_spans_shorter_than_the_minimum_run_on():
    cpu = FakeCpu()
    load = IdleLoad(window_s=100.0, read=cpu, min_span_s=1.0)
    load.sample(0.0, working=False)
    cpu.seconds = 0.01  # one clock tick
    load.sample(0.05, working=False)  # a poke right after: no span of 0.2 cores
    cpu.seconds = 0.2
    load.sample(2.0, working=False)
    assert load.cores == pytest.approx(0.1)


def test_a_working_sample_does_not_read_the_cpu_time():
    reads = []
    load = IdleLoad(read=lambda: reads.append(1) or 0.0)
    load.sample(0.0, working=True)
    assert reads == []  # a /proc scan is not free, and a working span is dropped anyway
