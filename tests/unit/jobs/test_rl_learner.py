"""``Learner``'s starting point: the spec's ``init_checkpoint`` (a ``peerd fetch`` model file), then its warm-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.errors import ConfigError
from peerd.jobs.rl import Learner, RLPlan
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.models import save_checkpoint
from peerd.rl.warmup import supervised_warmup

JOB: dict[str, Any] = {
    "kind": "rl",
    "model": {"preset": "tiny", "overrides": {"d_model": 32}, "seed": 1},
    "steps": 2,
    "global_batch": 16,
    "micro_batch": 16,
    "optimizer": {"name": "adamw", "lr": 1e-3, "schedule": "constant"},
    "rl": {
        "task": {"name": "addition", "min_size": 1, "max_size": 1},
        "group_size": 4,
        "sampling": {"max_new_tokens": 3},
        "warmup": {"steps": 0, "batch_size": 8},
    },
}


def spec(**top: Any) -> JobSpec:
    return parse_job_spec({**JOB, **top})


def saved(tmp: Path, s: JobSpec, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model file of ``s``'s model initialised from ``seed``, and its weights."""
    family = dataclasses.replace(s.model, seed=seed).family()
    weights = family.build().state_dict()
    return save_checkpoint(tmp / "model.pt", family, weights), weights


def test_the_policy_and_its_reference_start_from_the_checkpoint(tmp_path: Path) -> None:
    path, weights = saved(tmp_path, spec(), seed=42)
    learner = Learner(RLPlan("j" * 32, spec(init_checkpoint=str(path))))
    seeded = Learner(RLPlan("j" * 32, spec())).policy.state_dict()
    learner.warm_up()
    for name, tensor in weights.items():
        assert torch.equal(learner.policy.state_dict()[name], tensor), name
        assert torch.equal(learner.reference.state_dict()[name], tensor), name
    assert any(not torch.equal(seeded[k], weights[k]) for k in weights)  # the seed's init is another


def test_the_warm_up_continues_from_the_checkpoint(tmp_path: Path) -> None:
    warm = {**JOB["rl"], "warmup": {"steps": 3, "batch_size": 8, "seed": 5}}
    path, weights = saved(tmp_path, spec(), seed=42)
    learner = Learner(RLPlan("j" * 32, spec(init_checkpoint=str(path), rl=warm)))
    learner.warm_up()
    by_hand = Learner(RLPlan("j" * 32, spec(rl=warm)))
    by_hand.policy.load_state_dict(weights)
    supervised_warmup(by_hand.policy, by_hand.plan.task, by_hand.plan.rl.warmup)
    for name, tensor in by_hand.policy.state_dict().items():
        assert torch.equal(learner.policy.state_dict()[name], tensor), name
        assert torch.equal(learner.reference.state_dict()[name], tensor), name


def test_a_checkpoint_that_does_not_fit_the_model_or_is_missing_fails_naming_the_field(
    tmp_path: Path,
) -> None:
    wide = spec(model={**JOB["model"], "overrides": {"d_model": 64}})
    path, _ = saved(tmp_path, wide, seed=0)
    with pytest.raises(ConfigError) as err:
        Learner(RLPlan("j" * 32, spec(init_checkpoint=str(path)))).warm_up()
    assert err.value.field == "init_checkpoint" and "shape" in err.value.detail
    with pytest.raises(ConfigError) as err:
        Learner(RLPlan("j" * 32, spec(init_checkpoint=str(tmp_path / "none.pt")))).warm_up()
    assert err.value.field == "init_checkpoint" and "no such file" in err.value.detail
