"""Vote counting: quorum sizes, equivocation, and the round-1 adoption rule on hand-made ballots."""

from __future__ import annotations

import itertools

import pytest

from peerd.sched.consensus.messages import Vote
from peerd.sched.consensus.tally import Ballot, adoption_choice, quorum

VIEW = b"v" * 32
X, Y, Z = b"x" * 32, b"y" * 32, b"z" * 32


def ballot(votes: dict[str, bytes], view: bytes = VIEW) -> Ballot:
    b = Ballot()
    for voter, cid in votes.items():
        assert b.add(Vote("j", 0, 0, voter, 1.0, cid, 1.0, view)) == "new"
    return b


def members(n: int) -> frozenset[str]:
    return frozenset(f"p{i}" for i in range(n))


@pytest.mark.parametrize("n", range(1, 40))
@pytest.mark.parametrize("faulty", [0, 1, 2])
def test_two_quorums_always_share_an_honest_voter(n: int, faulty: int) -> None:
    q = quorum(n, faulty)
    assert 2 * q - n > faulty  # the smallest possible overlap exceeds the liars
    if faulty < n:
        assert q <= n  # a unanimous roster can always commit


def test_ballot_detects_duplicates_and_equivocation() -> None:
    b = Ballot()
    v = Vote("j", 0, 0, "p1", 1.0, X, 1.0, VIEW)
    assert b.add(v) == "new"
    assert b.add(v) == "duplicate"
    assert b.add(Vote("j", 0, 0, "p1", 1.0, Y, 1.0, VIEW)) == "equivocation"
    assert b.votes == {} and b.add(v) == "ignored"


def test_counting_stays_within_one_roster_view() -> None:
    b = ballot({"p0": X, "p1": X})
    b.add(Vote("j", 0, 0, "p2", 1.0, X, 1.0, b"w" * 32))
    b.add(Vote("j", 0, 0, "p9", 1.0, X, 1.0, VIEW))
    assert b.tally(VIEW, members(4)) == {X: 2}


def test_adopts_the_only_candidate_that_may_have_committed() -> None:
    # 7 peers, quorum 4, one vote unseen: X (3 + 1) may have committed, Y (2 + 1) may not.
    b = ballot({"p0": X, "p1": X, "p2": X, "p3": Y, "p4": Y, "p5": Z})
    assert adoption_choice(b, VIEW, members(7), 4, {}) == X


def test_abstains_when_two_candidates_may_have_committed() -> None:
    # 5 peers, quorum 3, two votes unseen: X (1 + 2) and Y (2 + 2) are both possible.
    b = ballot({"p0": X, "p3": Y, "p4": Y})
    assert adoption_choice(b, VIEW, members(5), 3, {}) is None


def test_abstains_when_so_many_votes_are_unseen_that_anything_may_have_committed() -> None:
    b = ballot({"p0": X, "p1": X})
    assert adoption_choice(b, VIEW, members(6), 4, {}) is None


def test_plurality_then_cost_then_id_when_nothing_can_have_committed() -> None:
    # 5 peers, all seen, quorum 3: nobody reached it.
    assert (
        adoption_choice(
            ballot({"p0": X, "p1": Y, "p2": Y, "p3": Z, "p4": X}), VIEW, members(5), 3, {X: 2.0, Y: 1.0}
        )
        == Y
    )
    assert (
        adoption_choice(
            ballot({"p0": X, "p1": Y, "p2": Y, "p3": Z, "p4": X}), VIEW, members(5), 3, {X: 1.0, Y: 2.0}
        )
        == X
    )
    tie = ballot({"p0": X, "p1": Y, "p2": Y, "p3": Z, "p4": X})
    assert adoption_choice(tie, VIEW, members(5), 3, {X: 1.0, Y: 1.0}) == min(X, Y)


def test_costs_of_unknown_candidates_come_from_the_votes() -> None:
    b = Ballot()
    for voter, cid, cost in [("p0", X, 5.0), ("p1", X, 5.0), ("p2", Y, 3.0), ("p3", Y, 3.0), ("p4", Z, 1.0)]:
        b.add(Vote("j", 0, 0, voter, 1.0, cid, cost, VIEW))
    assert adoption_choice(b, VIEW, members(5), 3, {}) == Y


def test_the_adoption_rule_never_contradicts_a_possible_commit_exhaustively() -> None:
    """Every way 5 voters can split over 3 candidates, every subset a peer may have seen:
    if some candidate has a quorum, no peer's round-1 choice is another candidate."""
    peers = [f"p{i}" for i in range(5)]
    for votes in itertools.product([X, Y, Z], repeat=5):
        committed = [c for c in (X, Y, Z) if votes.count(c) >= 3]
        for k in range(6):
            for seen in itertools.combinations(range(5), k):
                choice = adoption_choice(ballot({peers[i]: votes[i] for i in seen}), VIEW, members(5), 3, {})
                if committed and choice is not None:
                    assert choice == committed[0]


def test_replan_choice_prefers_the_repair_within_the_margin_and_keeps_the_shape() -> None:
    from peerd.sched.allocation import Allocation
    from peerd.sched.consensus.tally import moved_tasklets, replan_choice

    prev = Allocation.from_plain([["a", "b"], ["c", "d"]])
    repair = Allocation.from_plain([["a", "b"], ["c", "e"]])  # e fills d's slot: 1 moved
    swap = Allocation.from_plain([["a", "c"], ["b", "e"]])  # b and c change stage: 3 moved
    deeper = Allocation.from_plain([["a"], ["b"], ["c"]])
    split = Allocation.from_plain([["a", "b"], ["c", "e"]], layers=(1, 3))
    assert (moved_tasklets(repair, prev), moved_tasklets(swap, prev)) == (1, 3)
    allocs = {b"r": repair, b"s": swap, b"d": deeper, b"l": split}
    assert replan_choice({b"r": 10.0, b"s": 9.6}, allocs, prev, 0.05) == b"r"  # 4 % gain: keep
    assert replan_choice({b"r": 10.0, b"s": 9.0}, allocs, prev, 0.05) == b"s"  # 10 % gain: move
    assert replan_choice({b"r": 10.0, b"d": 1.0, b"l": 1.0}, allocs, prev, 0.05) == b"r"
    assert replan_choice({b"d": 1.0, b"l": 1.0}, allocs, prev, 0.05) is None


def test_anchored_needs_a_majority_of_the_running_roster() -> None:
    from peerd.sched.consensus.tally import anchored

    running = frozenset("abcde")
    assert anchored({"a", "b", "c"}, running) and anchored({"a", "b", "c", "x", "y"}, running)
    assert not anchored({"a", "b", "x", "y", "z"}, running)  # a quorum of its view, 2 of the 5 anchors
    assert anchored({"x"}, frozenset())  # no anchor (epoch 0, or long after the running commit)
