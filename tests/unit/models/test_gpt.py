"""GPT model: shapes, causality, seeded per-layer init, presets, and the analytic cost helpers."""

from __future__ import annotations

import pytest
import torch

from peerd.errors import ConfigError
from peerd.models.costs import layer_costs, matmul_params, param_count, stage_costs
from peerd.models.gpt import GPT, PRESETS, GPTConfig, build_layer, lm_loss

TINY = GPTConfig.preset("tiny")


def test_forward_shapes_and_layer_list() -> None:
    model = GPT(TINY, seed=1)
    assert len(model.layers) == TINY.n_layer + 2
    tokens = torch.randint(0, 256, (3, 16))
    hidden = model.layers[0](tokens)
    assert hidden.shape == (3, 16, TINY.d_model)
    assert model(tokens).shape == (3, 16, 256)


def test_forward_equals_running_layers_in_order() -> None:
    model = GPT(TINY, seed=1)
    tokens = torch.randint(0, 256, (2, 12))
    x = tokens
    for layer in model.layers:
        x = layer(x)
    torch.testing.assert_close(model(tokens), x, rtol=0, atol=0)


def test_attention_is_causal() -> None:
    model = GPT(TINY, seed=2).eval()
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_weights_other_seed_differs() -> None:
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    for (na, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), na
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), na


def test_layer_built_alone_equals_layer_in_full_model() -> None:
    model = GPT(TINY, seed=3)
    for i in range(TINY.num_layers):
        alone = build_layer(TINY, i, seed=3)
        for (name, p_full), (_, p_alone) in zip(
            model.layers[i].named_parameters(), alone.named_parameters(), strict=True
        ):
            assert torch.equal(p_full, p_alone), (i, name)


def test_init_statistics_follow_gpt2() -> None:
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=256)
    model = GPT(cfg, seed=0)
    block = model.layers[1]
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    assert abs(block.mlp.proj.weight.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.001
    assert torch.all(block.ln1.weight == 1) and torch.all(block.attn.qkv.bias == 0)


def test_weight_tying_shares_the_table() -> None:
    cfg = GPTConfig(tie_weights=True)
    model = GPT(cfg, seed=0)
    assert model.layers[-1].lm_head.weight is model.layers[0].tok.weight
    assert model.num_parameters() == param_count(cfg)


@pytest.mark.parametrize("name", ["tiny", "tiny-4", "mini"])
def test_param_count_matches_built_model(name: str) -> None:
    cfg = GPTConfig.preset(name)
    model = GPT(cfg)
    assert model.num_parameters() == param_count(cfg)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    assert per_layer == [c.params for c in layer_costs(cfg)]


@pytest.mark.parametrize("tie", [False, True])
def test_matmul_params_are_the_linear_weights_a_token_multiplies(tie: bool) -> None:
    cfg = GPTConfig(tie_weights=tie)
    model = GPT(cfg, seed=0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(cfg) == linear  # a tied head multiplies the embedding table: counted once
    assert matmul_params(cfg) < param_count(cfg)  # the lookups, norms and biases multiply nothing


def test_large_presets_have_published_sizes() -> None:
    # GPT-2 paper sizes (117M/345M/762M/1542M quoted; exact counts with tied embeddings below).
    assert param_count(GPTConfig.preset("gpt2")) == 124_439_808
    assert param_count(GPTConfig.preset("gpt2-medium")) == 354_823_168
    assert abs(param_count(GPTConfig.preset("gpt2-xl")) / 1.558e9 - 1) < 0.01
    assert abs(param_count(GPTConfig.preset("gpt3-xl")) / 1.3e9 - 1) < 0.02
    assert set(PRESETS) >= {"tiny", "gpt2", "gpt2-medium", "gpt2-xl", "gpt3-xl"}


def test_flops_roughly_six_n_per_token_for_training() -> None:
    cfg = GPTConfig.preset("gpt2-medium")
    fwd = sum(c.fwd_flops_per_token for c in layer_costs(cfg, seq_len=1024))
    # The classic 2N forward FLOPs per token (N = non-embedding params + head), plus attention.
    n_matmul = cfg.n_layer * 12 * cfg.d_model**2 + cfg.d_model * cfg.vocab_size
    assert 2 * n_matmul < fwd < 2 * n_matmul * 1.15


def test_stage_costs_sum_layers() -> None:
    cfg = GPTConfig.preset("tiny-4")
    stages = stage_costs(cfg, [2, 2, 2])
    assert sum(s.params for s in stages) == param_count(cfg)
    assert stages[0].out_elems_per_token == cfg.d_model and stages[-1].out_elems_per_token == 256
    with pytest.raises(ConfigError):
        stage_costs(cfg, [3, 2])


def test_invalid_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="n_head"):
        GPT(GPTConfig(d_model=64, n_head=3))
    with pytest.raises(ConfigError, match="preset"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ConfigError, match="max_seq_len"):
        GPT(TINY)(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_one_training_step_lowers_loss_on_repeated_batch() -> None:
    torch.manual_seed(0)
    model = GPT(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(5):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)
    assert losses[-1] < losses[0] - 0.1
