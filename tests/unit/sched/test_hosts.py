"""Peers on one machine share its cores: the slowdown of each while some of them compute at once."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from peerd.errors import ConfigError
from peerd.loading import from_mapping
from peerd.sched.hosts import HostLoad, HostShare, loopback_factors, slowdowns

BOX = HostShare("box", cores=2, threads=1)


def test_more_busy_threads_than_cores_slow_every_busy_peer_of_that_machine() -> None:
    shares = [BOX, BOX, BOX, BOX]
    assert slowdowns(shares, {0, 1, 2, 3}) == [2.0, 2.0, 2.0, 2.0]
    assert slowdowns(shares, {0, 1, 2}) == [1.5, 1.5, 1.5, 1.0]  # the idle one keeps its rate
    assert slowdowns(shares, {0, 1}) == [1.0, 1.0, 1.0, 1.0]  # two threads on two cores


def test_threads_count_and_other_machines_are_apart() -> None:
    wide = HostShare("box", cores=2, threads=2)
    other = HostShare("other", cores=1, threads=1)
    assert slowdowns([wide, wide, other], {0, 1, 2}) == [2.0, 2.0, 1.0]
    # a peer with no machine declared (an accelerator, an older peer) is never slowed
    assert slowdowns([None, None, BOX], {0, 1, 2}) == [1.0, 1.0, 1.0]


def test_a_machine_has_the_most_cores_any_of_its_peers_declares() -> None:
    small = HostShare("box", cores=1, threads=1)
    assert slowdowns([small, BOX, BOX], {0, 1, 2}) == [1.5, 1.5, 1.5]


def test_a_host_share_is_checked_where_it_is_read() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(HostShare, {"host": "", "cores": 0})
    assert "cores" in str(err.value) and "host" in str(err.value)


def test_a_loopback_link_slows_with_its_machines_cores_and_a_link_between_machines_does_not() -> None:
    box, other = HostShare("box", cores=2), HostShare("other", cores=2)
    shares = [box, box, box, other, None]
    factors = slowdowns(shares, {0, 1, 2, 3, 4})
    assert factors == [1.5, 1.5, 1.5, 1.0, 1.0]
    links = loopback_factors(shares, factors)
    assert links[0][1] == links[1][0] == links[2][0] == 1.5  # on the busy machine
    assert links[0][0] == 1.0  # no link to itself
    assert links[0][3] == links[3][0] == 1.0  # between two machines: a wire
    assert links[0][4] == links[4][4] == 1.0  # a host nobody declared
    # an idle peer of the busy machine still talks over its cores
    assert loopback_factors(shares, slowdowns(shares, {0, 1, 2}))[2][0] == 1.5


def test_host_load_gives_each_layouts_busy_devices_what_slowdowns_gives() -> None:
    wide, small, other = HostShare("box", 2, 2), HostShare("box", 1, 1), HostShare("other", 1, 1)
    shares = [BOX, wide, small, None, other, other, BOX]
    load = HostLoad.of(shares)
    assert load is not None and HostLoad.of([None, None]) is None
    layouts = np.array([list(c) for c in itertools.combinations(range(len(shares)), 4)])
    got = load.factors(layouts)
    for row, busy in zip(got, layouts, strict=True):
        want = slowdowns(shares, set(busy.tolist()))
        assert row.tolist() == pytest.approx([want[i] for i in busy])


def test_the_busiest_machine_counts_its_devices_work_over_the_cores_its_daemons_leave() -> None:
    shares = [HostShare("a", 2), HostShare("a", 2), HostShare("b", 4), None]
    load = HostLoad(shares, idle=[0.5, 0.5, 0.0, 3.0])
    devices = np.array([[0, 1, 2, 3], [0, 2, 3, 3]])
    seconds = np.array([[1.0, 1.0, 2.0, 100.0], [1.0, 6.0, 100.0, 100.0]])
    # layout 0: a has 2 s over 1 free core, b 2 s over 4; layout 1: a 1 s over 1, b 6 s over 4;
    # a device of no known machine (3) counts nowhere
    np.testing.assert_allclose(load.busiest(devices, seconds), [2.0, 1.5])
    # daemons that declare more idle load than cores leave a tenth of them
    assert HostLoad([HostShare("a", 2)], idle=[5.0]).busiest(np.array([[0]]), np.array([[1.0]]))[0] == 5.0
