"""``peerd fetch``'s assembly: per-stage checkpoints written by the pipeline code become one loadable GPT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peerd.errors import ConfigError
from peerd.jobs.fetch import assemble, load_model
from peerd.jobs.spec import load_job_spec
from peerd.models.gpt import GPT
from peerd.pipeline import checkpoint
from peerd.pipeline.partition import partition

SPEC = load_job_spec("configs/jobs/gpt-tiny-demo.yaml")
JOB = "f" * 32
LAYERS = [2, 1, 1]


def _save_stages(root: Path, model: GPT, step: int, replicas_by_stage: dict[int, int]) -> None:
    stages = partition(model, LAYERS)
    for s, stage in enumerate(stages):
        replica = replicas_by_stage.get(s)
        if replica is None:
            continue
        state = {
            "format": checkpoint.FORMAT,
            "job": JOB,
            "stage": s,
            "replica": replica,
            "step": step,
            "module": stage.state_dict(),
            "optimizer": {},
            "data": {},
            "meta": {"layers": [stage.spec.start, stage.spec.end]},
        }
        checkpoint.save(checkpoint.tasklet_dir(root, JOB, s, replica), state)


def test_stages_from_several_peers_assemble_into_the_model(tmp_path: Path) -> None:
    gpt = SPEC.model.gpt_config()
    trained = GPT(gpt, seed=7)  # weights unlike a fresh init, so a mix-up would show
    peers = [tmp_path / f"peer{i}" for i in range(3)]
    _save_stages(peers[0], trained, 40, {0: 0})
    _save_stages(peers[1], trained, 40, {1: 1, 2: 0})
    _save_stages(peers[2], GPT(gpt, seed=8), 20, {0: 1, 1: 0, 2: 1})  # an older, different step
    result = assemble(JOB, SPEC, peers, tmp_path / "out")
    assert result.step == 40 and result.stages == 3
    model, meta = load_model(result.path)
    assert meta["job"] == JOB and meta["step"] == 40
    for (name, a), (_, b) in zip(model.state_dict().items(), trained.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(tokens), trained(tokens))
    assert (tmp_path / "out" / "job.json").exists()


def test_missing_stages_and_steps_are_config_errors(tmp_path: Path) -> None:
    gpt = SPEC.model.gpt_config()
    with pytest.raises(ConfigError, match="no checkpoints"):
        assemble(JOB, SPEC, [tmp_path], tmp_path / "out")
    _save_stages(tmp_path / "a", GPT(gpt), 10, {0: 0, 2: 0})
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\]"):
        assemble(JOB, SPEC, [tmp_path / "a"], tmp_path / "out")
    _save_stages(tmp_path / "b", GPT(gpt), 30, {1: 0})
    with pytest.raises(ConfigError, match="no checkpointed step in common"):
        assemble(JOB, SPEC, [tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ConfigError):
        load_model(tmp_path / "junk.pt")
