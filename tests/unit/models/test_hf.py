"""HF adapter: staged GPT-2 / Llama forward equals the HF model's own forward (random configs, no hub)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="optional extra: transformers is not installed")

from peerd.errors import ConfigError  # noqa: E402
from peerd.models.hf import HFStagedLM, build_hf_model  # noqa: E402
from peerd.pipeline.local import LocalPipeline, MicroBatch  # noqa: E402
from peerd.pipeline.partition import partition, shared_parameters  # noqa: E402

GPT2 = dict(
    n_layer=3,
    n_embd=32,
    n_head=2,
    vocab_size=256,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
LLAMA = dict(
    num_hidden_layers=3,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("model_type", "config"), [("gpt2", GPT2), ("llama", LLAMA)])
def test_staged_forward_equals_full_model(model_type: str, config: dict, attn: str) -> None:
    model = build_hf_model(model_type, seed=1, attn_implementation=attn, **config).eval()
    staged = HFStagedLM(model)
    assert len(staged.layers) == 5
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expect = model(input_ids=tokens).logits
        x = tokens
        for stage in partition(staged, [2, 1, 2]):
            x = stage(x)
    torch.testing.assert_close(x, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("model_type", "config"), [("gpt2", GPT2), ("llama", LLAMA)])
def test_pipelined_gradients_equal_full_model_gradients(model_type: str, config: dict) -> None:
    a = build_hf_model(model_type, seed=2, **config)
    b = build_hf_model(model_type, seed=2, **config)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = a(input_ids=x).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()
    stages = partition(HFStagedLM(b), [2, 3])
    LocalPipeline(stages, "1f1b").forward_backward(
        [MicroBatch([0, 1], x[:2], y[:2]), MicroBatch([2, 3], x[2:], y[2:])]
    )
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_same_seed_same_weights_and_tied_embedding_is_reported() -> None:
    a, b = build_hf_model("gpt2", seed=3, **GPT2), build_hf_model("gpt2", seed=3, **GPT2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert shared_parameters(partition(HFStagedLM(a), [2, 3])) == [(0, 1)]


def test_unsupported_model_types_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not supported"):
        build_hf_model("bert")
    with pytest.raises(ConfigError, match="not supported"):
        HFStagedLM(torch.nn.Linear(2, 2))


def test_unexpected_hf_layout_is_a_config_error_naming_the_submodule() -> None:
    model = build_hf_model("llama", **LLAMA)
    del model.model.rotary_emb  # what a differently structured checkpoint class would look like
    with pytest.raises(ConfigError, match="rotary_emb"):
        HFStagedLM(model)
    gpt2 = build_hf_model("gpt2", **GPT2)
    gpt2.transformer.h = torch.nn.Linear(2, 2)  # blocks that are not a ModuleList
    with pytest.raises(ConfigError, match="h: a Linear, expected a ModuleList"):
        HFStagedLM(gpt2)
