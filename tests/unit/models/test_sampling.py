"""Sampling: temperature and top-k shape the next-token distribution; a seed fixes the text;
``peerd generate`` prints a fetched model's continuation through the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from peerd.errors import ConfigError
from peerd.models import save_checkpoint
from peerd.models.gpt import GPTConfig
from peerd.models.registry import GPTFamily
from peerd.models.sampling import SamplingConfig, decode, encode, next_token_distribution, sample

PEERD = [sys.executable, "-c", "from peerd.cli import main; main()"]


def test_temperature_and_top_k_shape_the_distribution() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p1 = next_token_distribution(logits, 1.0, None)
    assert torch.allclose(p1, torch.softmax(logits, -1))
    cold, hot = next_token_distribution(logits, 0.5, None), next_token_distribution(logits, 2.0, None)
    assert cold[0] > p1[0] > hot[0]
    top2 = next_token_distribution(logits, 1.0, 2)
    assert top2[2:].sum() == 0 and torch.allclose(top2[:2], torch.softmax(logits[:2], -1))
    assert next_token_distribution(logits, 0.0, None).tolist() == [1.0, 0.0, 0.0, 0.0]


def _model() -> torch.nn.Module:
    return GPTFamily(GPTConfig(n_layer=1, d_model=32, max_seq_len=16), seed=4).build()


def test_a_seed_fixes_the_text_and_the_context_window_slides() -> None:
    model, prompt = _model(), encode("héllo")
    config = SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=20, seed=7)
    a, b = sample(model, prompt, config, context=16), sample(model, prompt, config, context=16)
    assert a == b and a[: len(prompt)] == prompt and len(a) == len(prompt) + 40  # beyond max_seq_len
    assert sample(model, prompt, SamplingConfig(max_new_tokens=40, seed=8), context=16) != a
    greedy = sample(model, prompt, SamplingConfig(max_new_tokens=5, temperature=0), context=16)
    assert greedy == sample(
        model, prompt, SamplingConfig(max_new_tokens=5, temperature=0, seed=9), context=16
    )
    assert decode(encode("héllo")) == "héllo" and decode([0xFF]) == "\ufffd"
    with pytest.raises(ConfigError, match="prompt"):
        sample(model, [], config, context=16)
    with pytest.raises(ConfigError, match="top_k"):
        sample(model, prompt, SamplingConfig(top_k=0), context=16)


def test_peerd_generate_prints_the_prompt_and_its_continuation(tmp_path) -> None:
    family = GPTFamily(GPTConfig(n_layer=1, d_model=32, max_seq_len=16), seed=4)
    path = save_checkpoint(tmp_path / "out" / "model.pt", family, family.build().state_dict(), step=3)
    args = [
        "generate",
        str(path),
        "--prompt",
        "To be",
        "--max-new-tokens",
        "12",
        "--top-k",
        "5",
        "--seed",
        "1",
    ]
    run = subprocess.run([*PEERD, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    want = decode(sample(family.build(), encode("To be"), SamplingConfig(12, 1.0, 5, 1), context=16))
    assert run.stdout == want + "\n" and run.stdout.startswith("To be")
    bad = subprocess.run([*PEERD, "generate", str(tmp_path), "--prompt", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "without weights" in bad.stderr


def test_an_hf_model_file_samples_only_bytes(tmp_path) -> None:
    pytest.importorskip("transformers", reason="optional extra: transformers is not installed")
    from peerd.models import open_checkpoint
    from peerd.models.registry import build_family

    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}  # vocab 50257
    family = build_family("gpt2", {**config, "tie_word_embeddings": False}, seed=1)
    path = save_checkpoint(tmp_path / "model.pt", family, family.build().state_dict())
    ck = open_checkpoint(path)
    ids = sample(
        ck.model, encode("ab"), SamplingConfig(max_new_tokens=20, seed=2), context=ck.family.max_seq_len
    )
    assert len(ids) == 22 and max(ids) < 256
