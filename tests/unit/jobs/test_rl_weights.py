"""The rl weights blob on the job's real GPT: what a rollout peer loads is the trainer's policy, bit for bit."""

from __future__ import annotations

import pytest
import torch

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.spec import parse_job_spec
from peerd.rl.weights import pack_weights, read_weights


def gpt(overrides: dict, seed: int):
    spec = parse_job_spec(
        {
            "kind": "rl",
            "min_peers": 2,
            "model": {"preset": "tiny", "seed": seed, "overrides": overrides},
            "steps": 4,
            "global_batch": 16,
            "micro_batch": 8,
            "rl": {"task": {"name": "addition"}, "group_size": 4},
        }
    )
    return spec.model.family().build()


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": True}], ids=["untied", "tied"])
def test_a_policy_read_from_its_blob_is_the_trainers_policy(overrides: dict) -> None:
    trainer, rollout = gpt(overrides, seed=1), gpt(overrides, seed=2)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p))
    read_weights(pack_weights(9, trainer.state_dict()), rollout.state_dict(), 9)
    tokens = torch.randint(0, 256, (3, 7))
    assert torch.equal(trainer(tokens), rollout(tokens))


def test_a_blob_for_another_width_is_refused_before_any_weight_changes() -> None:
    wide, narrow = gpt({"d_model": 128}, seed=1), gpt({"d_model": 32}, seed=2)
    before = {k: v.clone() for k, v in narrow.state_dict().items()}
    with pytest.raises(ProtocolError) as info:
        read_weights(pack_weights(0, wide.state_dict()), narrow.state_dict(), 0)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert all(torch.equal(before[k], v) for k, v in narrow.state_dict().items())


def test_only_float32_weights_are_packed() -> None:
    with pytest.raises(ValueError, match="float32"):
        pack_weights(0, {"w": torch.zeros(2, dtype=torch.bfloat16)})
