"""Robust-aggregation hook: the mean (default, bit-identical to the fixed-order sum), the clipped mean, the screen."""

from __future__ import annotations

import math

import pytest
import torch

from peerd.averaging.aggregate import ClippedMean, Mean, parse_aggregator, screen
from peerd.averaging.core import MemberMath, simulate
from peerd.errors import ConfigError, ErrorCode, PeerMisbehaved


def _parts(n: int, numel: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def test_mean_is_the_fixed_order_sum_over_d_bit_for_bit():
    parts = _parts(4)
    want = ((parts[0] + parts[1]) + parts[2] + parts[3]) / 4
    got = Mean().aggregate(parts)
    assert torch.equal(got, want) and all(got is not p for p in parts)
    assert torch.equal(Mean().aggregate(parts[:1]), parts[0]) and Mean().aggregate(parts[:1]) is not parts[0]


def test_clipped_mean_bounds_one_huge_contribution_and_leaves_honest_ones_alone():
    honest = _parts(4, seed=1)
    assert torch.allclose(ClippedMean(2.0).aggregate(honest), Mean().aggregate(honest))  # norms within 2x
    attacked = [*honest[:3], honest[3] * 1e6]
    plain, clipped = Mean().aggregate(attacked), ClippedMean(2.0).aggregate(attacked)
    median = sorted(float(p.norm()) for p in attacked)[1:3]
    bound = 2.0 * sum(median) / 2
    # the attacker moves the clipped mean by at most bound / D; the plain mean by ~1e6 / D
    assert float((clipped - Mean().aggregate([*honest[:3], torch.zeros(1000)])).norm()) <= bound / 4 * 1.0001
    assert float(plain.norm()) > 1e5 * float(clipped.norm())


def test_members_reduce_through_the_configured_aggregator():
    flats = [torch.full((10,), float(v)) for v in (1.0, 2.0, 3.0, 1e4)]
    plain = simulate([MemberMath(r, 4, None) for r in range(4)], flats)[0]
    robust = simulate([MemberMath(r, 4, None, "clipped") for r in range(4)], flats)[0]
    assert torch.allclose(plain, torch.full((10,), (6 + 1e4) / 4))
    assert float(robust.max()) < 3.0  # the outlier clipped to 2x the median norm (2.5): (1+2+3+5)/4


def test_the_screen_refuses_absurd_contributions_relative_to_the_members_whole_gradient():
    parts = _parts(3, seed=2)
    whole = float(torch.linalg.vector_norm(torch.cat(parts)))  # as if the member's gradient held these
    screen(parts, 0, whole, 1e3, ["a", "b", "c"])
    parts[2] = parts[2] * 1e4
    with pytest.raises(PeerMisbehaved) as info:
        screen(parts, 0, whole, 1e3, ["a", "b", "c"])
    assert info.value.peer == "c" and info.value.code == ErrorCode.OUT_OF_RANGE
    assert "whole gradient" in info.value.message
    # an honest spike: this member's slice of the share is ~0 (an embedding its batch never
    # touched), another's is 1,600x larger, and still far below this member's whole gradient
    screen([torch.full((5,), 1e-4), torch.full((5,), 0.16)], 0, 1.5, 1e3, ["a", "b"])
    screen([torch.zeros(5), torch.ones(5) * 1e9], 0, 0.0, 1e3, ["a", "b"])  # no scale: nothing to judge by
    with pytest.raises(PeerMisbehaved):
        screen([torch.ones(5), torch.full((5,), math.nan)], 0, 1.0, 1e3, ["a", "b"])


def test_aggregators_by_name_and_bad_names():
    assert isinstance(parse_aggregator(None), Mean) and isinstance(parse_aggregator("Clipped"), ClippedMean)
    with pytest.raises(ConfigError):
        parse_aggregator("median-of-means")
    with pytest.raises(ConfigError):
        ClippedMean(0.5)
