"""A timed-out ``SwarmJob.wait`` says why: the daemons' warnings and errors, tracebacks whole."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from peerd.bench.churn import SwarmJob
from peerd.errors import PeerdError

LOG = """\
2026-12-04 23:40:09,977 INFO    peerd.jobs.planner: committed allocation 317f (epoch 0)
2026-12-04 23:40:50,282 WARN    peerd.jobs.runner: job j: tasklet s1r1 stopped at step 442
2026-12-04 23:40:51,000 INFO    peerd.pipeline.worker: stage 1 replica 1 resumes at step 442
2026-12-04 23:40:52,000 ERROR   peerd.jobs.runner: job j: tasklet s1r1 crashed
Traceback (most recent call last):
  File "runner.py", line 1, in _run_tasklet
KeyError: 'step'
2026-12-04 23:40:53,000 INFO    peerd.jobs.planner: re-planning
"""


def swarm_with_logs(tmp_path: Path, texts: dict[str, str]) -> SimpleNamespace:
    peers = []
    for name, text in texts.items():
        (tmp_path / name).mkdir()
        log = tmp_path / name / "daemon.log"
        log.write_text(text)
        peers.append(SimpleNamespace(name=name, log_path=log, alive=False, info=None))
    missing = SimpleNamespace(name="gone", log_path=tmp_path / "gone" / "daemon.log", alive=False, info=None)
    return SimpleNamespace(peers=[*peers, missing], live_peers=lambda: [])


def test_warnings_keep_each_warning_and_error_with_its_traceback_and_nothing_else(tmp_path: Path) -> None:
    job = SwarmJob(swarm_with_logs(tmp_path, {"peer0": LOG, "peer1": "no records at all\n"}), "j")  # type: ignore[arg-type]
    assert job.warnings().splitlines() == [
        "peer0: 2026-12-04 23:40:50,282 WARN    peerd.jobs.runner: job j: tasklet s1r1 stopped at step 442",
        "peer0: 2026-12-04 23:40:52,000 ERROR   peerd.jobs.runner: job j: tasklet s1r1 crashed",
        "peer0: Traceback (most recent call last):",
        'peer0:   File "runner.py", line 1, in _run_tasklet',
        "peer0: KeyError: 'step'",
    ]
    assert job.warnings(per_peer=1) == "peer0: KeyError: 'step'"


def test_a_timed_out_wait_names_what_it_waited_for_and_the_daemons_warnings(tmp_path: Path) -> None:
    job = SwarmJob(swarm_with_logs(tmp_path, {"peer0": LOG}), "j")  # type: ignore[arg-type]
    with pytest.raises(PeerdError, match=r"(?s)waiting for the job to grow.*KeyError: 'step'"):
        job.wait(lambda views: True, 0, "the job to grow")
