"""Which step's frames a member accepts, and the per-step collection of contributions to its share.

Window: before its first step a member accepts any step (a group may resume at step k);
while step ``t`` runs it accepts ``t`` and ``t+1`` (a faster member may have finished ``t``
and sent ``t+1`` already; it cannot be further ahead, since finishing ``t+1`` needs this
member); between steps, after completing ``t``, it accepts only ``t+1``. Everything else is
WRONG_STEP, and at most two steps are held at once. The last completed step's answer is kept
(``answered``): a member retrying that step after this one finished it gets the same share again.
"""

from __future__ import annotations

import asyncio

import torch

from peerd.averaging.messages import AvgMessage, Expect, check
from peerd.compress.gradient import Encoded
from peerd.errors import ErrorCode, PeerdError, ProtocolError

MAX_HELD = 2


class StepState:
    """Contributions to this member's share for one step and, once reduced, the answer."""

    def __init__(self, step: int) -> None:
        loop = asyncio.get_running_loop()
        self.step = step
        self.total: int | None = None
        self.layout: str | None = None
        self.parts: dict[int, torch.Tensor] = {}  # rank -> contribution (share,)
        self.overflowed: set[int] = set()  # ranks whose contribution says its fp16 gradients overflowed
        self.result: asyncio.Future[Encoded] = loop.create_future()
        self.reducing: asyncio.Task | None = None  # the reduction, once all contributions are in
        self.touched = loop.time()  # last progress: a contribution arrived
        self.all_in: float | None = None
        """``time.perf_counter()`` when the last contribution arrived (the reduction started)."""
        self.scale = 0.0
        """The norm of this member's whole gradient, once it contributed: what the others' are judged by."""

    def add(self, src: int, part: torch.Tensor, overflowed: bool = False) -> None:
        """Record ``src``'s contribution; a resent one replaces it unless the reduction already started."""
        if self.reducing is None:
            self.parts[src] = part
            self.overflowed.discard(src)
            if overflowed:
                self.overflowed.add(src)
            self.touched = asyncio.get_running_loop().time()

    def abort(self, exc: PeerdError) -> None:
        if not self.result.done():
            self.result.set_exception(exc)
            self.result.exception()  # mark retrieved: nobody may be waiting


class StepBook:
    """Step bookkeeping of one member: the running step, the last completed one, held states."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.current: int | None = None
        self.last: int | None = None
        self.states: dict[int, StepState] = {}
        self.answered: StepState | None = None
        """The last completed step's state while its reduced share is known (the reply to a late part)."""

    def late(self, step: int) -> StepState | None:
        """The state whose answer a part for ``step`` gets again: ``step`` was this member's last."""
        done = self.answered
        if done is None or done.step != step or not done.result.done() or done.result.exception() is not None:
            return None
        return done

    def check_window(self, step: int) -> None:
        """WRONG_STEP unless a frame for ``step`` may be accepted now."""
        cur, last = self.current, self.last
        if last is not None and step <= last:
            raise ProtocolError(
                f"step {step} is over on rank {self.rank} (last: {last})", code=ErrorCode.WRONG_STEP
            )
        if (cur is not None and step not in (cur, cur + 1)) or (
            cur is None and last is not None and step != last + 1
        ):
            now = cur if cur is not None else last
            raise ProtocolError(
                f"step {step} is too far from rank {self.rank}'s step {now}", code=ErrorCode.WRONG_STEP
            )

    def admit(self, msg: AvgMessage, digest: str) -> StepState:
        """The state a checked, decoded contribution joins (created when it comes first)."""
        self.check_window(msg.step)
        state = self.states.get(msg.step)
        if state is None:
            if len(self.states) >= MAX_HELD:
                held = sorted(self.states)
                raise ProtocolError(f"rank {self.rank} already holds steps {held}", code=ErrorCode.WRONG_STEP)
            state = self.states[msg.step] = StepState(msg.step)
        if state.total is None:
            state.total, state.layout = msg.total, msg.layout
        check(msg, Expect(digest, total=state.total, layout=state.layout))
        return state

    def begin(self, step: int, total: int, layout: str) -> StepState:
        """Start the local step: drop states outside the window, bind this member's gradient layout."""
        if self.last is not None and step <= self.last:
            raise ProtocolError(
                f"step {step} is already averaged (last: {self.last})", code=ErrorCode.WRONG_STEP
            )
        for s in [s for s in self.states if s not in (step, step + 1)]:
            self.states.pop(s).abort(
                ProtocolError(f"rank {self.rank} is at step {step}", code=ErrorCode.WRONG_STEP)
            )
        self.current = step
        state = self.states.get(step)
        if state is None:
            state = self.states[step] = StepState(step)
        elif state.total is not None and (state.total, state.layout) != (total, layout):
            raise ProtocolError(
                f"members sent gradients of {state.total} elements (layout {state.layout}); "
                f"this member has {total} (layout {layout})",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        state.total, state.layout = total, layout
        return state

    def finish(self, step: int) -> None:
        self.answered = self.states.pop(step, None)
        self.current = None
        self.last = step

    def fail(self, step: int, exc: PeerdError) -> None:
        """The local step failed: its state is dropped and whoever waits on it learns at once."""
        state = self.states.pop(step, None)
        if state is not None:
            state.abort(exc)
        self.current = None

    def abort_all(self, exc: PeerdError) -> None:
        for state in self.states.values():
            state.abort(exc)
        self.states.clear()
