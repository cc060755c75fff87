"""Model registry: each family's layers built one at a time equal the whole model (and HF's own model),
the cost model counts their parameters exactly, and checkpoints load layer by layer."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="optional extra: transformers is not installed")

from peerd.errors import ConfigError  # noqa: E402
from peerd.models import load_checkpoint, open_checkpoint, save_checkpoint  # noqa: E402
from peerd.models.gpt import GPTConfig  # noqa: E402
from peerd.models.hf import HFStagedLM  # noqa: E402
from peerd.models.registry import GPTFamily, HFFamily, ModelFamily, build_family, family_from, with_weights  # noqa: E402

GPT2 = dict(
    model_type="gpt2",
    n_layer=2,
    n_embd=32,
    n_head=2,
    vocab_size=256,
    n_positions=64,
    tie_word_embeddings=False,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
LLAMA = dict(
    model_type="llama",
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)
FAMILIES = [("gpt2", GPT2), ("llama", LLAMA)]


def hf_model_of(family: ModelFamily) -> torch.nn.Module:
    """HF's own model class holding the family's weights (names mapped by the family's prefixes)."""
    assert isinstance(family, HFFamily)
    return family.to_hf(family.build()).eval()


@pytest.mark.parametrize(("name", "config"), FAMILIES)
def test_hf_layers_built_alone_compute_what_the_hf_model_computes(name: str, config: dict) -> None:
    family = build_family(name, config, seed=5)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = hf_model_of(family)(tokens).logits
    stack = family.build().eval()
    assert torch.allclose(stack(tokens), reference, atol=1e-6, rtol=0)
    assert torch.allclose(HFStagedLM(hf_model_of(family))(tokens), reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "config"), [("gpt", {**vars(GPTConfig(n_layer=3))}), *FAMILIES])
def test_every_peer_builds_the_same_layer_and_costs_count_its_parameters(name: str, config: dict) -> None:
    family = build_family(name, config, seed=11)
    whole = family.build()
    for i in (0, 1, family.num_layers - 1):
        alone = build_family(name, config, seed=11).build_layer(i)  # another process, only layer i
        for (k, a), (_, b) in zip(
            alone.state_dict().items(), whole.layers[i].state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), (i, k)
    other = build_family(name, config, seed=12).build_layer(1)
    assert not all(
        torch.equal(a, b) for a, b in zip(other.parameters(), whole.layers[1].parameters(), strict=True)
    )
    counted = [c.params for c in family.layer_costs(16)]
    actual = [sum(p.numel() for p in layer.parameters()) for layer in whole.layers]
    assert counted == actual
    assert family_from(family.describe()).describe() == family.describe()


def test_hf_configs_are_checked_field_by_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.hf\.n_layers.*not a field of GPT2Config"):
        build_family("gpt2", {**GPT2, "n_layers": 4})
    with pytest.raises(ConfigError, match=r"model\.hf\.model_type"):
        build_family("gpt2", {**GPT2, "model_type": "bert"})
    with pytest.raises(ConfigError, match="not a multiple of 3 heads"):
        build_family("gpt2", {**GPT2, "n_head": 3})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        build_family("llama", {**LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="unknown model family"):
        build_family("bert", {})
    # a record from another peer may hold anything: wrong types are named, never a TypeError later
    for bad, field in [
        ({"n_layer": "2"}, "n_layer"),
        ({"n_head": 0}, "n_head"),
        ({"layer_norm_epsilon": "x"}, "layer_norm_epsilon"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_family("gpt2", {**GPT2, **bad})
        assert err.value.field == f"model.hf.{field}"
    # sizes no model has, which would make a peer build per-layer tables it cannot hold
    with pytest.raises(ConfigError, match=r"in \[1, 1024\]"):
        build_family("llama", {**LLAMA, "num_hidden_layers": 10**9})
    with pytest.raises(ConfigError, match="intermediate_size"):
        build_family("llama", {**LLAMA, "intermediate_size": 10**12})
    with pytest.raises(ConfigError, match="n_layer"):
        build_family("gpt", {"n_layer": 10**9})


def test_a_tied_hf_model_shares_its_table_when_one_stage_builds_both_ends() -> None:
    family = build_family("gpt2", {**GPT2, "tie_word_embeddings": True})
    layers = [family.build_layer(i) for i in range(family.num_layers)]
    assert layers[-1].lm_head.weight is layers[0].wte.weight
    assert family.tied and sum(c.params for c in family.layer_costs(8)) == sum(
        p.numel() for p in torch.nn.ModuleList(layers).parameters()
    )


@torch.no_grad()
def _batch_loss(family: ModelFamily, tokens: torch.Tensor) -> float:
    model = family.build().eval()
    return float(family.loss(model(tokens[:, :-1]), tokens[:, 1:]))


@pytest.mark.parametrize(("name", "config"), FAMILIES)
def test_hf_weights_load_layer_by_layer_from_safetensors_and_save_pretrained(tmp_path, name, config) -> None:
    trained = build_family(name, config, seed=1)  # "pretrained": another seed than the job's
    hf_model = hf_model_of(trained)
    hf_model.save_pretrained(tmp_path / "pretrained")
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = float(trained.loss(hf_model(tokens[:, :-1]).logits, tokens[:, 1:]))
    job = build_family(name, config, seed=0)
    assert abs(_batch_loss(job, tokens) - expected) > 1e-3  # the seed's init is another model
    for path in (tmp_path / "pretrained", tmp_path / "pretrained" / "model.safetensors"):
        loaded = with_weights(job, str(path))
        assert abs(_batch_loss(loaded, tokens) - expected) < 1e-6
        alone, want = loaded.build_layer(1), trained.build_layer(1)  # one stage's layer gets its slice
        for a, b in zip(alone.parameters(), want.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_tied_hf_checkpoint_starts_an_untied_job_with_the_embedding_as_head(tmp_path) -> None:
    tied = build_family("gpt2", {**GPT2, "tie_word_embeddings": True}, seed=2)
    hf_model_of(tied).save_pretrained(tmp_path / "tied")  # saves no lm_head.weight
    job = with_weights(build_family("gpt2", GPT2), str(tmp_path / "tied"))
    head, embedding = job.build_layer(job.num_layers - 1), job.build_layer(0)
    assert torch.equal(head.lm_head.weight, embedding.wte.weight) and not job.tied


def test_a_model_file_loads_with_one_call_and_starts_the_same_model(tmp_path) -> None:
    for family in (GPTFamily(GPTConfig(n_layer=2), seed=3), build_family("llama", LLAMA, seed=3)):
        model = family.build()
        path = save_checkpoint(
            tmp_path / family.name / "model.pt", family, model.state_dict(), job="j", step=7
        )
        loaded = load_checkpoint(path)
        tokens = torch.randint(0, 256, (1, 12))
        assert torch.equal(loaded(tokens), model.eval()(tokens))
        ck = open_checkpoint(path.parent)  # the directory works too
        assert ck.meta["step"] == 7 and ck.family.describe() == family.describe()
        # a job of the same model starts from it; every layer gets its slice
        again = with_weights(family_from({**family.describe(), "seed": 99}), str(path))
        for i in range(family.num_layers):
            for a, b in zip(again.build_layer(i).parameters(), model.layers[i].parameters(), strict=True):
                assert torch.equal(a, b)


def test_checkpoint_errors_name_the_field(tmp_path) -> None:
    gpt = GPTFamily(GPTConfig(n_layer=2))
    with pytest.raises(ConfigError, match=r"init_checkpoint.*no such file") as err:
        with_weights(gpt, str(tmp_path / "nowhere"))
    assert err.value.field == "init_checkpoint"
    path = save_checkpoint(tmp_path / "m.pt", gpt, gpt.build().state_dict())
    with pytest.raises(ConfigError, match="holds a gpt model of 4 layers"):
        with_weights(GPTFamily(GPTConfig(n_layer=3)), str(path))
    with pytest.raises(ConfigError, match="holds a gpt model"):
        with_weights(build_family("llama", {**LLAMA, "num_hidden_layers": 2}), str(path))
    with pytest.raises(ConfigError, match="has shape"):
        with_weights(GPTFamily(GPTConfig(n_layer=2, d_model=32)), str(path)).build_layer(1)
    # a fine-tune may change what does not shape the weights (here dropout)
    with_weights(GPTFamily(GPTConfig(n_layer=2, dropout=0.1)), str(path)).build()
    hf_model_of(build_family("gpt2", GPT2)).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="only load into a Hugging Face model"):
        with_weights(gpt, str(tmp_path / "hf"))
    bigger = build_family("gpt2", {**GPT2, "n_embd": 64})
    with pytest.raises(ConfigError, match="has shape"):
        with_weights(bigger, str(tmp_path / "hf")).build_layer(0)
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a readable torch file"):
        load_checkpoint(tmp_path / "junk.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="without weights"):
        with_weights(bigger, str(tmp_path / "empty"))
