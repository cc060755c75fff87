"""Partition: uneven splits, validation, stages that compose to the full model, per-stage builds."""

from __future__ import annotations

import pytest
import torch

from peerd.errors import ConfigError
from peerd.models.gpt import GPT, GPTConfig, build_layer
from peerd.pipeline.partition import (
    balanced_layers_per_stage,
    build_stage,
    partition,
    shared_parameters,
    stage_specs,
    validate_layers_per_stage,
)

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32)  # 6 layers: emb, 4 blocks, head


@pytest.mark.parametrize("split", [[1, 5], [3, 3], [2, 1, 3], [1, 1, 1, 1, 1, 1], [6]])
def test_stages_compose_to_the_full_model(split: list[int]) -> None:
    model = GPT(CFG, seed=0)
    stages = partition(model, split)
    assert [len(s.layers) for s in stages] == split
    assert stages[0].is_first and stages[-1].is_last
    tokens = torch.randint(0, 256, (2, 9))
    x = tokens
    for st in stages:
        x = st(x)
    torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)
    # No copies: stage parameters are the model's.
    assert {id(p) for st in stages for p in st.parameters()} == {id(p) for p in model.parameters()}


def test_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="sums to 5"):
        validate_layers_per_stage(6, [2, 3])
    with pytest.raises(ConfigError, match=r"layers_per_stage\[1\]"):
        validate_layers_per_stage(6, [6, 0])
    with pytest.raises(ConfigError, match="at least one"):
        validate_layers_per_stage(6, [])
    with pytest.raises(ConfigError, match="num_stages"):
        balanced_layers_per_stage(3, 4)
    with pytest.raises(ConfigError, match="model"):
        partition(torch.nn.Linear(2, 2), [1])


def test_balanced_split_and_specs() -> None:
    assert balanced_layers_per_stage(14, 4) == [4, 4, 3, 3]
    specs = stage_specs(14, [4, 4, 3, 3])
    assert [(s.start, s.end) for s in specs] == [(0, 4), (4, 8), (8, 11), (11, 14)]


def test_a_stage_built_alone_equals_the_same_stage_of_the_full_model() -> None:
    model = GPT(CFG, seed=7)
    full = partition(model, [2, 2, 2])
    alone = build_stage(lambda i: build_layer(CFG, i, seed=7), CFG.num_layers, [2, 2, 2], stage=1)
    assert alone.spec == full[1].spec
    h = torch.randn(2, 5, CFG.d_model)
    torch.testing.assert_close(alone(h), full[1](h), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="stage"):
        build_stage(lambda i: build_layer(CFG, i), CFG.num_layers, [3, 3], stage=2)


def test_tied_weights_across_stages_are_reported() -> None:
    tied = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, tie_weights=True))
    assert shared_parameters(partition(tied, [2, 2])) == [(0, 1)]
    assert shared_parameters(partition(tied, [4])) == []
    assert shared_parameters(partition(GPT(CFG), [3, 3])) == []
