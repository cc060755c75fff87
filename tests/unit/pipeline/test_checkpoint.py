"""Stage checkpoints: atomic writes, pruning, the newest step common to all tasklets, refusing bad files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from peerd.errors import ConfigError
from peerd.pipeline import checkpoint


def state(step: int, **extra: object) -> dict:
    return {
        "format": checkpoint.FORMAT,
        "job": "j",
        "stage": 0,
        "replica": 0,
        "step": step,
        "module": {"w": torch.full((3,), float(step))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "data": {"epoch": 0, "batch": step},
        "meta": {"saved_at": 1.0},
        **extra,
    }


def test_save_load_round_trip_and_keep_the_newest(tmp_path: Path):
    d = checkpoint.tasklet_dir(tmp_path, "j", 0, 0)
    for step in (2, 4, 6):
        path = checkpoint.save(d, state(step), keep=2)
        assert path == checkpoint.checkpoint_file(d, step)
    assert checkpoint.saved_steps(d) == [4, 6]
    newest = checkpoint.load(d)
    assert newest["step"] == 6 and torch.equal(newest["module"]["w"], torch.full((3,), 6.0))
    assert checkpoint.load(d, 4)["data"]["batch"] == 4
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]  # no temporary files left


def test_checkpoints_younger_than_retain_s_outlive_keep(tmp_path: Path):
    d = checkpoint.tasklet_dir(tmp_path, "j", 0, 0)
    for step in (2, 4):
        checkpoint.save(d, state(step), keep=1)
    old = checkpoint.checkpoint_file(d, 2)
    assert not old.exists()  # retain_s 0: only the newest ``keep``
    for step in (6, 8, 10):
        checkpoint.save(d, state(step), keep=1, retain_s=60.0)
    assert checkpoint.saved_steps(d) == [4, 6, 8, 10]  # all written less than a minute ago
    aged = time.time() - 120
    for step in (4, 6):
        os.utime(checkpoint.checkpoint_file(d, step), (aged, aged))
    checkpoint.save(d, state(12), keep=1, retain_s=60.0)
    assert checkpoint.saved_steps(d) == [8, 10, 12]  # the two-minute-old ones go


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_debris(tmp_path: Path, monkeypatch):
    d = tmp_path / "t"
    checkpoint.save(d, state(1))

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(d, state(2))
    monkeypatch.undo()
    assert checkpoint.saved_steps(d) == [1]
    assert sorted(p.name for p in d.iterdir()) == ["step-00000001.pt"]


def test_a_temporary_left_by_a_crash_is_removed_by_the_next_save(tmp_path: Path):
    d = tmp_path / "t"
    checkpoint.save(d, state(1))
    (d / ".tmp-crashed.pt").write_bytes(b"half a checkpoint")  # a kill between write and rename
    checkpoint.save(d, state(2))
    assert sorted(p.name for p in d.iterdir()) == ["step-00000001.pt", "step-00000002.pt"]


def test_torn_and_foreign_files_are_ignored_or_refused(tmp_path: Path):
    d = tmp_path / "t"
    d.mkdir()
    (d / ".tmp-abc.pt").write_bytes(b"half a file")  # a crash mid-write: not a checkpoint
    assert checkpoint.saved_steps(d) == []
    with pytest.raises(ConfigError, match="no checkpoint"):
        checkpoint.load(d)
    checkpoint.checkpoint_file(d, 3).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        checkpoint.load(d)
    torch.save({"step": 4}, checkpoint.checkpoint_file(d, 4))
    with pytest.raises(ConfigError, match="not a peerd stage checkpoint"):
        checkpoint.load(d, 4)
    checkpoint.save(d, state(5, format=99))
    with pytest.raises(ConfigError, match="format 99"):
        checkpoint.load(d, 5)


def test_loading_never_runs_code_from_the_file(tmp_path: Path):
    d = tmp_path / "t"
    d.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({**state(1), "meta": Evil()}, checkpoint.checkpoint_file(d, 1))
    with pytest.raises(ConfigError):
        checkpoint.load(d)
    assert not (tmp_path / "pwned").exists()


def test_common_step_is_the_newest_step_every_tasklet_saved(tmp_path: Path):
    tasklets = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert checkpoint.common_step(tmp_path, "j", tasklets) is None
    for s, r in tasklets:
        for step in (4, 8):
            checkpoint.save(
                checkpoint.tasklet_dir(tmp_path, "j", s, r), {**state(step), "stage": s, "replica": r}
            )
    checkpoint.save(checkpoint.tasklet_dir(tmp_path, "j", 1, 1), {**state(12), "stage": 1, "replica": 1})
    assert checkpoint.common_step(tmp_path, "j", tasklets) == 8  # (1, 1) got further before the kill
    assert checkpoint.common_step(tmp_path, "other-job", tasklets) is None
