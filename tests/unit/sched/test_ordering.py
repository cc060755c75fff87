"""Bottleneck matching and open-loop TSP against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from peerd.sched.ordering import _heuristic_path, bottleneck_assignment, open_path, path_cost


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_bottleneck_matches_brute_force(n):
    rng = np.random.default_rng(n)
    for _ in range(25):
        cost = rng.integers(0, 6, size=(n, n)).astype(float)  # many ties on purpose
        m = bottleneck_assignment(cost)
        perms = list(itertools.permutations(range(n)))
        best = min(max(cost[i, p[i]] for i in range(n)) for p in perms)
        best_sum = min(
            sum(cost[i, p[i]] for i in range(n))
            for p in perms
            if max(cost[i, p[i]] for i in range(n)) == best
        )
        assert m.bottleneck == best
        assert m.total == pytest.approx(best_sum)
        assert sorted(m.perm) == list(range(n))
        assert max(cost[i, m.perm[i]] for i in range(n)) == best


def test_bottleneck_hand_case():
    # Matching rows to columns straight costs max 9; crossing costs max 2.
    cost = np.array([[9.0, 1.0], [2.0, 9.0]])
    m = bottleneck_assignment(cost)
    assert (m.bottleneck, m.perm) == (2.0, (1, 0))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_held_karp_matches_brute_force(n):
    rng = np.random.default_rng(10 + n)
    for symmetric in (True, False):
        w = rng.random((n, n))
        if symmetric:
            w = w + w.T
        cost, order = open_path(w)
        brute = min(path_cost(w, p) for p in itertools.permutations(range(n)))
        assert cost == pytest.approx(brute)
        assert sorted(order) == list(range(n))
        assert path_cost(w, order) == pytest.approx(cost)


def test_heuristic_is_a_valid_path_close_to_exact():
    rng = np.random.default_rng(3)
    gaps = []
    for _ in range(5):
        pts = rng.random((12, 2))
        w = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
        exact, _ = open_path(w)
        heur, order = _heuristic_path(w)
        assert sorted(order) == list(range(12))
        assert heur == pytest.approx(path_cost(w, order))
        assert heur >= exact - 1e-12
        gaps.append(heur / exact)
    assert max(gaps) < 1.10  # 2-opt + Or-opt from all nearest-neighbour starts on Euclidean points


def test_large_path_uses_heuristic_and_is_valid():
    rng = np.random.default_rng(4)
    w = rng.random((40, 40))
    w = w + w.T
    cost, order = open_path(w)
    assert sorted(order) == list(range(40)) and cost == pytest.approx(path_cost(w, order))
