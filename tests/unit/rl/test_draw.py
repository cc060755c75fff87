"""Drawing tokens by inverting each row's CDF: the distribution asked for, never an impossible token."""

from __future__ import annotations

import torch

from peerd.rl.rollout import draw


def test_draws_follow_the_row_probabilities():
    probs_BV = torch.tensor([[0.1, 0.2, 0.7], [5.0, 0.0, 5.0]])  # rows need not sum to one
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros(2, 3)
    for _ in range(n // 500):
        picked = torch.stack([draw(probs_BV, gen) for _ in range(500)])  # (500, 2)
        for row in range(2):
            counts[row] += torch.bincount(picked[:, row], minlength=3)
    freq = counts / n
    assert torch.allclose(freq[0], torch.tensor([0.1, 0.2, 0.7]), atol=0.015)
    assert counts[1, 1] == 0 and abs(freq[1, 0].item() - 0.5) < 0.015


def test_zero_probability_tokens_are_never_drawn_even_at_the_edges():
    probs_BV = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [2.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        assert draw(probs_BV, gen).tolist() == [1, 3, 0]


def test_the_same_generator_state_draws_the_same_tokens():
    probs_BV = torch.rand(16, 256)
    a = draw(probs_BV, torch.Generator().manual_seed(7))
    b = draw(probs_BV, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (16,) and a.dtype == torch.long
