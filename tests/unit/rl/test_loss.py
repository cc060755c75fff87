"""GRPO loss terms pinned on hand-computed cases: advantages, clipped ratio, k3 KL, masking, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from peerd.errors import ConfigError
from peerd.loading import from_mapping
from peerd.rl.loss import GRPOLossConfig, group_advantages, grpo_loss, k3_kl


def test_group_advantages_by_hand():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(1/3)
    # group 2: all equal -> advantage 0 (eps keeps it finite)
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]])
    a = group_advantages(r, eps=1e-4)
    s = math.sqrt(1 / 3) + 1e-4
    torch.testing.assert_close(a[0], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]))
    torch.testing.assert_close(a[1], torch.zeros(4))


def test_advantages_refuse_groups_of_one():
    with pytest.raises(ConfigError):
        group_advantages(torch.tensor([[1.0], [0.0]]), eps=1e-4)


def test_k3_by_hand_and_zero_at_equal_logprobs():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    # d = log(0.25/0.5) = -log 2: exp(d) - d - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]))
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def _case():
    # two rows, three target positions; row 0: completion at positions 1, 2; row 1: position 0 only
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    # ratios row 0: exp(0.5) (1.65, above 1.2), exp(-0.1) (0.905, inside); row 1: exp(-1) (0.37, below 0.8)
    logp = torch.tensor([[9.0, 0.5, -0.1], [-1.0, 7.0, 7.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    return logp, old, adv, mask


def test_clipped_surrogate_by_hand_without_kl():
    logp, old, adv, mask = _case()
    cfg = GRPOLossConfig(kl_coef=0.0)
    parts = grpo_loss(logp, old, None, adv, mask, cfg)
    # row 0, A=+1: min(1.6487, 1.2) = 1.2 (clipped); min(0.9048, 0.9048) = 0.9048
    # row 1, A=-2: min(0.3679 * -2, 0.8 * -2) = -1.6 (clipped: the lower of the two)
    surr = [1.2, math.exp(-0.1), -1.6]
    assert parts.loss.item() == pytest.approx(-sum(surr) / 3, rel=1e-6)
    assert parts.policy == pytest.approx(sum(surr) / 3, rel=1e-6)
    assert parts.clip_fraction == pytest.approx(2 / 3)
    assert parts.kl == 0.0
    parts.loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * ratio / n_tokens; masked ones none
    expected = torch.tensor([[0.0, 0.0, -math.exp(-0.1) / 3], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)


def test_kl_term_and_seq_mean_by_hand():
    logp, old, adv, mask = _case()
    ref = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    cfg = GRPOLossConfig(kl_coef=0.5, aggregation="seq-mean")
    parts = grpo_loss(logp, old, ref, adv, mask, cfg)
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(0.1) - 0.1 - 1, math.exp(1.0) - 1.0 - 1]
    tok = [-1.2 + 0.5 * kl[0], -math.exp(-0.1) + 0.5 * kl[1], 1.6 + 0.5 * kl[2]]
    # seq-mean: row 0 averages its two tokens, row 1 has one; then the rows are averaged
    assert parts.loss.item() == pytest.approx(((tok[0] + tok[1]) / 2 + tok[2]) / 2, rel=1e-6)
    assert parts.kl == pytest.approx(sum(kl) / 3, rel=1e-6)


def test_on_policy_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    torch.manual_seed(0)
    old = torch.randn(4, 5)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    mask = torch.ones(4, 5)
    parts = grpo_loss(logp, old, old, adv, mask, GRPOLossConfig())
    assert parts.ratio_mean == pytest.approx(1.0)
    assert parts.clip_fraction == 0.0 and parts.kl == pytest.approx(0.0)
    parts.loss.backward()
    torch.testing.assert_close(logp.grad, (-adv[:, None] / 20).expand(4, 5))


def test_masked_tokens_change_nothing():
    logp, old, adv, mask = _case()
    cfg = GRPOLossConfig(kl_coef=0.1)
    ref = torch.zeros(2, 3)
    a = grpo_loss(logp, old, ref, adv, mask, cfg).loss
    logp2 = logp.detach().clone()
    logp2[0, 0], logp2[1, 1:] = -50.0, 30.0  # values at masked positions only
    b = grpo_loss(logp2, old, ref, adv, mask, cfg).loss
    assert a.item() == pytest.approx(b.item())


def test_kl_needs_reference_and_config_bounds():
    logp, old, adv, mask = _case()
    with pytest.raises(ConfigError, match="reference"):
        grpo_loss(logp, old, None, adv, mask, GRPOLossConfig(kl_coef=0.1))
    for bad, field in [({"clip_low": 1.5}, "loss.clip_low"), ({"aggregation": "sum"}, "loss.aggregation")]:
        with pytest.raises(ConfigError) as exc:
            from_mapping(GRPOLossConfig, bad, "loss")
        assert field in {e.field for e in exc.value.errors}
