"""The KV-cached forward equals the model's own forward; batched generation with ragged prompts."""

from __future__ import annotations

import pytest
import torch

from peerd.errors import ConfigError
from peerd.models.gpt import GPT, GPTConfig
from peerd.rl.kvcache import KVCache, cached_forward
from peerd.rl.rollout import SamplingConfig, generate, layout, rollout, token_logprobs
from peerd.rl.tasks import END_TOKEN, PAD_TOKEN, TaskConfig, make_task

CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=32)


def _model(seed: int = 0) -> GPT:
    return GPT(CFG, seed=seed).eval()


def _decode_with_cache(model: GPT, tokens_1T: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (1, T, V): the first ``prefill`` tokens at once, then one token per step."""
    T = tokens_1T.shape[1]
    cache = KVCache(model, 1, T)
    mask = torch.ones((1, T), dtype=torch.bool)
    pos = torch.arange(T)[None]
    out = [cached_forward(model, tokens_1T[:, :prefill], pos[:, :prefill], mask[:, :prefill], cache)]
    for t in range(prefill, T):
        out.append(cached_forward(model, tokens_1T[:, t : t + 1], pos[:, t : t + 1], mask[:, : t + 1], cache))
    return torch.cat(out, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("prefill", [1, 5, 12])
def test_cached_logits_equal_the_uncached_forward(prefill):
    model = _model(1)
    tokens = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        _decode_with_cache(model, tokens, prefill), model(tokens), rtol=1e-5, atol=1e-5
    )


@torch.no_grad()
def test_left_padded_rows_equal_their_unpadded_forward():
    model = _model(2)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 256, (n,), generator=gen) for n in (7, 3, 5)]
    P = 7
    tokens = torch.full((3, P), PAD_TOKEN)
    mask = torch.zeros((3, P), dtype=torch.bool)
    pos = torch.zeros((3, P), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, P - len(r) :] = r
        mask[i, P - len(r) :] = True
        pos[i, P - len(r) :] = torch.arange(len(r))
    cache = KVCache(model, 3, P + 1)
    logits = cached_forward(model, tokens, pos, mask, cache)
    nxt = torch.tensor([[11], [12], [13]])
    mask = torch.cat([mask, torch.ones((3, 1), dtype=torch.bool)], dim=1)
    step = cached_forward(model, nxt, torch.tensor([[7], [3], [5]]), mask, cache)
    assert torch.isfinite(logits).all()
    for i, r in enumerate(rows):
        full = model(torch.cat([r, nxt[i]])[None])
        torch.testing.assert_close(logits[i, P - len(r) :], full[0, : len(r)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[i, 0], full[0, -1], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_greedy_generation_equals_argmax_of_the_full_forward():
    model = _model(3)
    prompts = [[50, 51, 52, 53], [60, 61]]
    g = generate(model, prompts, SamplingConfig(max_new_tokens=6, temperature=0), torch.Generator())
    for prompt, comp, lps in zip(prompts, g.completions, g.logprobs, strict=True):
        seq = list(prompt)
        for tok, lp in zip(comp, lps, strict=True):
            logp = torch.log_softmax(model(torch.tensor([seq]))[0, -1], dim=-1)
            assert tok == int(logp.argmax())
            assert lp == pytest.approx(float(logp[tok]), abs=1e-5)
            seq.append(tok)
        assert len(comp) == 6 or comp[-1] == END_TOKEN


def test_behaviour_logprobs_equal_the_trainers_and_sampling_is_seeded():
    model = _model(4)
    task = make_task(TaskConfig(name="addition", max_size=2))
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.7, top_k=20)
    problems = task.problems(3, seed=0)
    a = rollout(model, problems, 4, cfg, torch.Generator().manual_seed(5), version=7)
    b = rollout(model, problems, 4, cfg, torch.Generator().manual_seed(5), version=7)
    c = rollout(model, problems, 4, cfg, torch.Generator().manual_seed(6), version=7)
    assert [g.completions for g in a] == [g.completions for g in b]
    assert [g.completions for g in a] != [g.completions for g in c]
    assert all(g.version == 7 and g.size == 4 for g in a)
    prompts = [g.problem.prompt_ids for g in a for _ in range(g.size)]
    comps = [c for g in a for c in g.completions]
    tokens, mask = layout(prompts, comps)
    lp = token_logprobs(model, tokens, temperature=0.7)
    for i, lps in enumerate(lp for g in a for lp in g.logprobs):
        start = len(prompts[i]) - 1
        torch.testing.assert_close(lp[i, start : start + len(lps)], torch.tensor(lps), rtol=0, atol=1e-5)
        assert mask[i].sum() == len(lps)


def test_top_k_limits_the_tokens_drawn():
    model = _model(5)
    cfg = SamplingConfig(max_new_tokens=1, temperature=1.0, top_k=3)
    g = generate(model, [[40, 41]] * 200, cfg, torch.Generator().manual_seed(0))
    top3 = set(torch.topk(model(torch.tensor([[40, 41]]))[0, -1], 3).indices.tolist())
    drawn = {c[0] for c in g.completions}
    assert drawn <= top3 and len(drawn) > 1


def test_generation_stops_at_the_end_marker():
    model = _model(6)
    head = model.layers[-1]
    with torch.no_grad():  # a constant component in the final norm's output, read by the END row only
        head.ln_f.bias.fill_(1.0)
        head.lm_head.weight[END_TOKEN].fill_(2.0)
    g = generate(model, [[1, 2, 3]], SamplingConfig(max_new_tokens=8), torch.Generator().manual_seed(0))
    assert g.completions == [[END_TOKEN]]


def test_too_long_for_the_model_and_other_models_are_refused():
    model = _model(7)
    with pytest.raises(ConfigError) as exc:
        generate(model, [[1] * 30], SamplingConfig(max_new_tokens=8), torch.Generator())
    assert exc.value.field == "max_new_tokens"
    with pytest.raises(ConfigError) as exc:
        generate(torch.nn.Linear(2, 2), [[1]], SamplingConfig(), torch.Generator())  # type: ignore[arg-type]
    assert exc.value.field == "model"
    with pytest.raises(ConfigError):
        generate(model, [[]], SamplingConfig(), torch.Generator())
