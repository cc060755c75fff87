"""Resume step, holders and repairs: pure functions of the committed roster."""

from __future__ import annotations

from peerd.jobs.recovery import (
    cheapest_repair,
    held_state,
    holders,
    patch_allocation,
    resume_step,
    stage_layers,
)
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import RosterDevice, RosterEntry

SPANS = stage_layers([2, 1, 1])


def entry(peer: str, *held, tflops: float = 10.0) -> RosterEntry:
    return RosterEntry("job", 4, peer, 1.0, RosterDevice(tflops, 1 << 30), (), tuple(held))


def test_stage_layers() -> None:
    assert SPANS == [(0, 2), (2, 3), (3, 4)]


def test_resume_at_the_newest_step_every_stage_has() -> None:
    roster = [
        entry("a", held_state(0, (0, 2), [9, 10])),
        entry("b", held_state(1, (2, 3), [10, 11])),  # one step ahead: rolls back to 10
        entry("c", held_state(2, (3, 4), [10])),
        entry("d"),  # a newcomer holds nothing
    ]
    assert resume_step(roster, SPANS) == 10


def test_a_stage_nobody_holds_resumes_from_its_checkpoints_or_from_scratch() -> None:
    roster = [entry("a", held_state(0, (0, 2), [5, 10, 11])), entry("c", held_state(2, (3, 4), [5, 11]))]
    assert resume_step(roster, SPANS) == 0  # stage 1 is held by nobody: from the seed
    roster.append(entry("e", held_state(1, (2, 3), [5, 8])))  # a checkpoint replica of stage 1
    assert resume_step(roster, SPANS) == 5


def test_state_of_another_layer_split_does_not_count() -> None:
    roster = [
        entry("a", held_state(0, (0, 1), [10])),
        entry("b", held_state(1, (2, 3), [10])),
        entry("c", held_state(2, (3, 4), [10])),
    ]
    assert resume_step(roster, SPANS) == 0


def test_holders_are_ordered_alike_everywhere_and_held_state_keeps_the_newest() -> None:
    roster = [entry(p, held_state(1, (2, 3), [7])) for p in "xyz"] + [entry("w", held_state(1, (2, 3), [6]))]
    order = holders(roster, 1, (2, 3), 7, job="job")
    assert sorted(order) == ["x", "y", "z"] and order == holders(
        list(reversed(roster)), 1, (2, 3), 7, job="job"
    )
    assert held_state(0, (0, 2), range(40)).steps == tuple(range(24, 40))


def test_patch_fills_holes_with_the_fastest_free_peer_or_narrows() -> None:
    prev = Allocation.from_plain([["a", "b"], ["c", "d"]], layers=(2, 2))
    roster = [entry(p) for p in "abc"] + [entry("e", tflops=5.0), entry("f", tflops=50.0)]
    wide = patch_allocation(prev, roster, [2, 1])
    assert (
        wide[0].stages == (("a", "b"), ("c", "f")) and wide[0].spares == ("e",) and wide[0].layers == (2, 2)
    )
    assert wide[1].stages == (("a",), ("c",))  # the damaged replica dropped; b joins the spares
    assert set(wide[1].spares) == {"b", "e", "f"}
    few = [entry(p) for p in "abc"]
    assert [a.d_dp for a in patch_allocation(prev, few, [2, 1])] == [1]


def test_a_wider_repair_is_chosen_only_for_a_gain_above_the_margin():
    narrow = Allocation.from_plain([["a"], ["b"]], ["c", "d"])
    wide = Allocation.from_plain([["a", "c"], ["b", "d"]])
    assert cheapest_repair([(0.96, wide), (1.0, narrow)], 1, 0.05) == (
        1.0,
        narrow,
    )  # 4 % faster: not worth it
    assert cheapest_repair([(0.90, wide), (1.0, narrow)], 1, 0.05) == (0.90, wide)
    assert cheapest_repair([(0.90, wide)], 1, 0.05) == (0.90, wide)  # no repair at the running width
    shrunk = Allocation.from_plain([["a"], ["b"]])
    assert cheapest_repair([(1.2, wide), (1.1, shrunk)], 2, 0.05) == (
        1.1,
        shrunk,
    )  # narrower: just the cheapest
