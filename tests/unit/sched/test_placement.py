"""Seeded random placement (the Megatron-like baseline): deterministic from public data, a valid allocation."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from peerd.errors import ConfigError
from peerd.sched.placement import placement_seed, random_allocation, seeded_shuffle
from peerd.sched.problem import Shape

IDS = [f"peer{i}" for i in range(8)]


def test_same_seed_same_allocation_whatever_the_input_order() -> None:
    seed = placement_seed("job-1", 0, 0)
    a = random_allocation(IDS, Shape(4, 2), seed)
    b = random_allocation(list(reversed(IDS)), Shape(4, 2), seed)
    assert a == b and a.digest() == b.digest()


def test_pinned_order_is_stable_across_versions() -> None:
    # SHA-256 only, no library RNG: this order must never change, or peers of different
    # versions would propose different baselines (and a benchmark's seeds would mean something else)
    assert placement_seed("job", 0, 0).hex()[:16] == "a4a481c72fd6c088"
    assert seeded_shuffle(IDS, placement_seed("job", 0, 0)) == [
        "peer5", "peer1", "peer4", "peer2", "peer3", "peer7", "peer0", "peer6"
    ]  # fmt: skip
    assert placement_seed("job", 0, 0) != placement_seed("job", "0", 0)  # types are part of the seed


def test_ranks_fill_stage_major_and_the_rest_are_spares() -> None:
    seed = placement_seed("job", 3, 1)
    order = seeded_shuffle(IDS, seed)
    alloc = random_allocation(IDS, Shape(3, 2), seed)
    assert alloc.stages == ((order[0], order[1]), (order[2], order[3]), (order[4], order[5]))
    assert alloc.spares == tuple(sorted(order[6:]))
    assert alloc.layers is None  # an even split, as a launcher without a cost model does
    assert sorted(alloc.devices + list(alloc.spares)) == sorted(IDS)


def test_different_seeds_and_epochs_give_different_orders() -> None:
    orders = {tuple(seeded_shuffle(IDS, placement_seed("job", s, e))) for s in range(10) for e in range(3)}
    assert len(orders) == 30


def test_shuffle_is_uniform_enough() -> None:
    # every device lands in every position about equally often (chi-square-style bound, 4 devices)
    ids = ["a", "b", "c", "d"]
    counts = Counter(tuple(seeded_shuffle(ids, placement_seed("u", i))) for i in range(4800))
    assert len(counts) == 24  # every permutation appears
    assert all(150 <= n <= 250 for n in counts.values()), counts  # expected 200 each
    first = Counter(p[0] for p in counts.elements())
    assert all(1050 <= n <= 1350 for n in first.values()), first


@pytest.mark.parametrize("d_pp, d_dp", list(itertools.product([1, 2, 4, 8], [1, 2])))
def test_every_fitting_shape_is_a_valid_allocation(d_pp: int, d_dp: int) -> None:
    if d_pp * d_dp > len(IDS):
        with pytest.raises(ConfigError, match="needs"):
            random_allocation(IDS, Shape(d_pp, d_dp), placement_seed("j"))
        return
    alloc = random_allocation(IDS, Shape(d_pp, d_dp), placement_seed("j"))
    assert (alloc.d_pp, alloc.d_dp) == (d_pp, d_dp)
    assert len(set(alloc.devices)) == d_pp * d_dp


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(ConfigError, match="unique"):
        random_allocation(["a", "a", "b"], Shape(1, 2), placement_seed("j"))
