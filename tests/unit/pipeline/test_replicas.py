"""Checkpoint replicas on disk: atomic puts, pruning, the byte budget, stale temporaries, providers, content checks.

tests/integration/test_statesync.py replicates over real p2pd daemons.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.pipeline import checkpoint
from peerd.pipeline.replicas import CheckpointReplicas, check_checkpoint, own_checkpoints
from peerd.pipeline.statesync import pack_state, unpack_state

JOB = "ab" * 16


def ckpt(stage: int, step: int, numel: int = 64, job: str = JOB) -> dict:
    return {
        "format": checkpoint.FORMAT,
        "job": job,
        "stage": stage,
        "replica": 0,
        "step": step,
        "module": {"w": torch.full((numel,), float(step))},
        "optimizer": {},
        "data": {"position": step},
        "meta": {},
    }


def blob(stage: int, step: int, numel: int = 64) -> bytes:
    return pack_state(ckpt(stage, step, numel))


def test_put_then_get_and_provider(tmp_path: Path):
    store = CheckpointReplicas(tmp_path, budget_bytes=1 << 20)
    data = blob(1, 10)
    path = store.put(JOB, 1, 10, data)
    assert path.read_bytes() == data and store.get(JOB, 1, 10) == data
    assert store.steps(JOB, 1) == [10] and store.latest(JOB, 1) == 10 and store.latest(JOB, 2) is None
    serve = store.provider(JOB)
    assert serve(1, 10) == data and serve(1, 11) is None and serve(2, 10) is None
    assert store.used_bytes == len(data)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    # the file is a checkpoint as checkpoint.load reads it
    assert checkpoint.load(path.parent, 10)["data"] == {"position": 10}


def test_old_steps_are_pruned_per_stage(tmp_path: Path):
    store = CheckpointReplicas(tmp_path, budget_bytes=1 << 20, keep=2)
    for step in (10, 20, 30):
        store.put(JOB, 1, step, blob(1, step))
        store.put(JOB, 2, step, blob(2, step))
    assert store.steps(JOB, 1) == [20, 30] and store.steps(JOB, 2) == [20, 30]


def test_budget_evicts_low_steps_first_and_the_newest_of_each_stage_last(tmp_path: Path):
    one = len(blob(0, 10, numel=4096))
    store = CheckpointReplicas(tmp_path, budget_bytes=int(one * 3.5), keep=2)
    store.put(JOB, 1, 10, blob(1, 10, 4096))
    store.put(JOB, 1, 20, blob(1, 20, 4096))
    store.put(JOB, 2, 10, blob(2, 10, 4096))
    assert store.used_bytes <= store.budget_bytes
    store.put(JOB, 3, 10, blob(3, 10, 4096))  # 4 copies > 3.5: stage 1's older step goes
    assert store.steps(JOB, 1) == [20] and store.steps(JOB, 2) == [10] and store.steps(JOB, 3) == [10]
    store.put(JOB, 4, 10, blob(4, 10, 4096))  # only newest copies left: the lowest step, first written, goes
    assert store.steps(JOB, 1) == [20] and store.steps(JOB, 2) == [] and store.steps(JOB, 3) == [10]
    assert store.steps(JOB, 4) == [10]
    assert store.used_bytes <= store.budget_bytes


def test_a_blob_above_the_budget_is_refused(tmp_path: Path):
    store = CheckpointReplicas(tmp_path, budget_bytes=100)
    with pytest.raises(ConfigError, match="does not fit the 100-byte budget"):
        store.put(JOB, 1, 10, blob(1, 10))
    assert store.steps(JOB, 1) == []


def test_stale_temporaries_are_removed_at_open_and_usage_survives_a_reopen(tmp_path: Path):
    store = CheckpointReplicas(tmp_path, budget_bytes=1 << 20)
    data = blob(1, 10)
    store.put(JOB, 1, 10, data)
    stale = store.directory(JOB, 1) / ".tmp-crashed.pt"
    stale.write_bytes(b"half a checkpoint")
    again = CheckpointReplicas(tmp_path, budget_bytes=1 << 20)
    assert not stale.exists()
    assert again.get(JOB, 1, 10) == data and again.used_bytes == len(data)


def test_own_checkpoints_serve_any_replica_of_the_stage(tmp_path: Path):
    state = ckpt(2, 30)
    checkpoint.save(checkpoint.tasklet_dir(tmp_path, JOB, 2, 1), state)
    serve = own_checkpoints(tmp_path, JOB)
    got = serve(2, 30)
    assert got is not None and unpack_state(got)["data"] == {"position": 30}
    assert serve(2, 31) is None and serve(1, 30) is None


@pytest.mark.parametrize(
    "state, code",
    [
        (ckpt(1, 10) | {"stage": 2}, ErrorCode.WRONG_STEP),
        (ckpt(1, 10) | {"step": 11}, ErrorCode.WRONG_STEP),
        (ckpt(1, 10, job="cd" * 16), ErrorCode.WRONG_STEP),
        (ckpt(1, 10) | {"format": 99}, ErrorCode.UNSUPPORTED_VERSION),
        ({"module": {}}, ErrorCode.MALFORMED),
    ],
    ids=["other-stage", "other-step", "other-job", "format", "not-a-checkpoint"],
)
def test_check_checkpoint_refuses_what_was_not_asked_for(state: dict, code: ErrorCode):
    check_checkpoint(blob(1, 10), JOB, 1, 10)
    with pytest.raises(ProtocolError) as err:
        check_checkpoint(pack_state(state), JOB, 1, 10)
    assert err.value.code == code


def test_config_is_validated(tmp_path: Path):
    with pytest.raises(ConfigError, match="budget_bytes"):
        CheckpointReplicas(tmp_path, budget_bytes=0)
    with pytest.raises(ConfigError, match="keep"):
        CheckpointReplicas(tmp_path, budget_bytes=10, keep=0)


def test_put_over_an_existing_step_replaces_it(tmp_path: Path):
    store = CheckpointReplicas(tmp_path, budget_bytes=1 << 20)
    store.put(JOB, 1, 10, b"first")
    store.put(JOB, 1, 10, b"second")
    assert store.get(JOB, 1, 10) == b"second" and len(os.listdir(store.directory(JOB, 1))) == 1
