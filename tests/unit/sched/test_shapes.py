"""Which pipeline shapes a roster allows: spares beside a fixed shape, auto widths that keep the batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from peerd.errors import ConfigError
from peerd.sched.planner import make_island, plan
from peerd.sched.problem import Shape, candidate_shapes
from peerd.sched.synthetic import random_cluster


def cluster(n: int, *, d_pp: int | str, d_dp: int | str, global_batch: int = 16, micro_batch: int = 4):
    sc = random_cluster(n, np.random.default_rng(7), layers=8)
    assert sc.training is not None
    training = dataclasses.replace(
        sc.training, d_pp=d_pp, d_dp=d_dp, global_batch=global_batch, micro_batch=micro_batch
    )
    return dataclasses.replace(sc, training=training)


def test_a_fixed_shape_on_a_larger_roster_leaves_spares() -> None:
    sc = cluster(5, d_pp=2, d_dp=2)
    assert candidate_shapes(sc, allow_spares=True) == [Shape(2, 2)]
    result = plan(sc, "peerd", seed=1, time_budget=2.0, generations=5)
    alloc = result.allocation
    assert (alloc.d_pp, alloc.d_dp) == (2, 2)
    assert len(alloc.spares) == 1
    assert sorted([*alloc.devices, *alloc.spares]) == sorted(d.id for d in sc.devices)


def test_a_fixed_shape_needs_enough_devices_and_dtfm_needs_them_all() -> None:
    with pytest.raises(ConfigError, match=r"3 devices but d_pp \* d_dp = 2 \* 2 = 4 tasklets need 4"):
        candidate_shapes(cluster(3, d_pp=2, d_dp=2), allow_spares=True)
    with pytest.raises(ConfigError, match="uses every device"):
        candidate_shapes(cluster(5, d_pp=2, d_dp=2), allow_spares=False)
    assert candidate_shapes(cluster(4, d_pp=2, d_dp=2), allow_spares=False) == [Shape(2, 2)]


def test_widths_keep_the_global_batch_as_whole_micro_batches() -> None:
    # 16 examples in micro-batches of 4: a replica can run 16, 8 or 4 of them, never 16 / 3
    shapes = candidate_shapes(cluster(6, d_pp="auto", d_dp="auto"), allow_spares=True)
    assert {s.d_dp for s in shapes} == {1, 2, 4}
    assert all(s.active <= 6 for s in shapes)
    assert Shape(2, 3) not in shapes and Shape(1, 4) in shapes and Shape(6, 1) in shapes
    # the yardstick uses every device and, unless asked, does not check the batch
    assert candidate_shapes(cluster(6, d_pp=2, d_dp="auto"), allow_spares=False) == [Shape(2, 3)]
    with pytest.raises(ConfigError, match="d_dp must divide global_batch / micro_batch = 16 / 4"):
        candidate_shapes(cluster(6, d_pp=2, d_dp="auto"), allow_spares=False, whole_micro_batches=True)
    with pytest.raises(ConfigError, match="do not split into 3 replicas"):
        candidate_shapes(cluster(6, d_pp=1, d_dp=3), allow_spares=True)


def test_an_auto_island_searches_one_of_the_given_shapes() -> None:
    sc = cluster(6, d_pp="auto", d_dp="auto")
    island = make_island(sc, "peerd", seed=3, shapes=[Shape(2, 2), Shape(3, 2)], time_budget=2.0)
    assert island.obj.shape in (Shape(2, 2), Shape(3, 2))
    island.step(2)
    best = island.best(1)[0]
    assert (best.d_pp, best.d_dp) == (island.obj.shape.d_pp, island.obj.shape.d_dp)
    assert len(best.spares) == 6 - island.obj.shape.active
    with pytest.raises(ConfigError, match="no pipeline shape"):
        make_island(sc, "peerd", seed=3, shapes=[], time_budget=1.0)
