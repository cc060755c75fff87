"""The step window: which step's frames a member accepts before, during and after its own steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peerd.averaging.messages import KIND_PART, AvgMessage
from peerd.averaging.steps import StepBook
from peerd.errors import ErrorCode, PeerUnavailable, ProtocolError

DIGEST = "0123456789abcdef"


def part(step: int, total: int = 10, layout: str = "L") -> AvgMessage:
    return AvgMessage(KIND_PART, DIGEST, step, 1, 0, total, layout)


def wrong_step(fn) -> None:
    with pytest.raises(ProtocolError) as info:
        fn()
    assert info.value.code == ErrorCode.WRONG_STEP


def run(coro_fn):
    async def go():
        return coro_fn()

    return asyncio.run(go())


def test_fresh_member_accepts_any_step_but_holds_at_most_two():
    def body():
        book = StepBook(0)
        book.admit(part(40), DIGEST)
        book.admit(part(41), DIGEST)
        wrong_step(lambda: book.admit(part(42), DIGEST))
        assert sorted(book.states) == [40, 41]

    run(body)


def test_running_step_accepts_itself_and_the_next_only():
    def body():
        book = StepBook(0)
        book.begin(5, 10, "L")
        book.admit(part(5), DIGEST)
        book.admit(part(6), DIGEST)
        wrong_step(lambda: book.check_window(4))
        wrong_step(lambda: book.check_window(7))
        book.finish(5)
        assert book.last == 5 and book.current is None
        wrong_step(lambda: book.check_window(5))  # over
        wrong_step(lambda: book.check_window(7))  # nobody can be two ahead
        book.check_window(6)
        wrong_step(lambda: book.begin(5, 10, "L"))

    run(body)


def test_begin_drops_states_outside_the_window_and_tells_their_waiters():
    def body():
        book = StepBook(0)
        stale = book.admit(part(3), DIGEST)
        book.begin(9, 10, "L")
        assert 3 not in book.states
        assert stale.result.done()
        assert stale.result.exception().code == ErrorCode.WRONG_STEP

    run(body)


def test_layouts_must_agree():
    def body():
        book = StepBook(0)
        book.admit(part(2, total=10), DIGEST)
        with pytest.raises(ProtocolError) as info:
            book.admit(part(2, total=11), DIGEST)
        assert info.value.code == ErrorCode.SHAPE_MISMATCH
        with pytest.raises(ProtocolError) as info:
            book.begin(2, 10, "other")
        assert info.value.code == ErrorCode.SHAPE_MISMATCH

    run(body)


def test_fail_aborts_the_step_and_resent_parts_replace_until_reduction():
    def body():
        book = StepBook(0)
        state = book.begin(1, 10, "L")
        state.add(1, torch.zeros(5))
        state.add(1, torch.ones(5))
        assert torch.equal(state.parts[1], torch.ones(5))
        book.fail(1, PeerUnavailable("gone"))
        assert isinstance(state.result.exception(), PeerUnavailable)
        assert book.current is None and book.last is None
        book.begin(1, 10, "L")  # the failed step may be retried

    run(body)


def test_the_last_completed_step_keeps_its_answer_for_late_parts_until_the_next_one():
    def body():
        book = StepBook(0)
        state = book.begin(3, 10, "L")
        book.finish(3)
        assert book.late(3) is None  # finished without an answer (nothing was reduced)
        state = book.begin(4, 10, "L")
        state.result.set_result("share of step 4")
        book.finish(4)
        assert book.late(4) is state and book.late(3) is None
        wrong_step(lambda: book.check_window(4))  # a late part is answered, never admitted again
        book.begin(5, 10, "L").result.set_result("share of step 5")
        book.finish(5)
        assert book.late(4) is None and book.late(5) is not None

    run(body)
