"""Micro-batch schedules: registry, dependency-correct message passing, 1F1B's bounded activations."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError
from peerd.pipeline.schedule import (
    Action,
    Op,
    Schedule,
    available_schedules,
    get_schedule,
    simulate,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 8), (4, 4), (4, 2), (5, 12)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("S", "M"), SIZES)
def test_schedules_run_to_completion_respecting_dependencies(name: str, S: int, M: int) -> None:
    sim = simulate(get_schedule(name), S, M)
    when = {(s, a.op, a.mb): t for t, (s, a) in enumerate(sim.events)}
    for s in range(S):
        for i in range(M):
            assert when[(s, Op.FORWARD, i)] < when[(s, Op.BACKWARD, i)]
            if s > 0:  # activations come from the previous stage's send
                assert when[(s - 1, Op.SEND_ACT, i)] < when[(s, Op.RECV_ACT, i)] < when[(s, Op.FORWARD, i)]
                assert when[(s, Op.BACKWARD, i)] < when[(s, Op.SEND_GRAD, i)]
            if s < S - 1:  # gradients come from the next stage's send
                assert when[(s + 1, Op.SEND_GRAD, i)] < when[(s, Op.RECV_GRAD, i)] < when[(s, Op.BACKWARD, i)]
    # Every action of every stage ran exactly once.
    assert len(when) == len(sim.events) == sum(len(get_schedule(name).actions(s, S, M)) for s in range(S))


@pytest.mark.parametrize(("S", "M"), SIZES)
def test_1f1b_bounds_in_flight_activations_gpipe_does_not(S: int, M: int) -> None:
    one = simulate(get_schedule("1f1b"), S, M)
    gp = simulate(get_schedule("gpipe"), S, M)
    assert one.peak_in_flight == [min(S - s, M) for s in range(S)]
    assert gp.peak_in_flight == [M] * S


def test_1f1b_has_no_worse_makespan_than_gpipe() -> None:
    for S, M in SIZES:
        assert simulate(get_schedule("1f1b"), S, M).rounds <= simulate(get_schedule("gpipe"), S, M).rounds


def test_first_and_last_stage_action_lists() -> None:
    gp = get_schedule("gpipe")
    assert [str(a) for a in gp.actions(0, 2, 2)] == [
        "forward(0)",
        "send_act(0)",
        "forward(1)",
        "send_act(1)",
        "recv_grad(0)",
        "backward(0)",
        "recv_grad(1)",
        "backward(1)",
    ]
    last = get_schedule("1f1b").actions(1, 2, 2)
    assert last[:3] == [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0)]
    assert Op.SEND_ACT not in {a.op for a in last} and Op.RECV_GRAD not in {a.op for a in last}


class _BackwardFirst(Schedule):
    name = "broken-backward-first"

    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        return [(Op.BACKWARD, i) for i in range(num_micro)] + [(Op.FORWARD, i) for i in range(num_micro)]


class _MissingForward(Schedule):
    """Forgets the last micro-batch's forward pass."""

    name = "broken-missing"

    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        return [(Op.FORWARD, i) for i in range(num_micro - 1)] + [(Op.BACKWARD, i) for i in range(num_micro)]


class _Deadlock(Schedule):
    """Stage 0 waits for mb 0's gradient before sending mb 1; the last stage wants mb 1 first."""

    name = "broken-deadlock"

    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        if stage == 0:
            return [(Op.FORWARD, 0), (Op.BACKWARD, 0), (Op.FORWARD, 1), (Op.BACKWARD, 1)]
        return [(Op.FORWARD, 1), (Op.BACKWARD, 1), (Op.FORWARD, 0), (Op.BACKWARD, 0)]


def test_simulation_rejects_broken_schedules() -> None:
    with pytest.raises(ConfigError, match="before"):
        simulate(_BackwardFirst(), 2, 2)
    with pytest.raises(ConfigError, match=r"runs forward on \[0\]"):
        simulate(_MissingForward(), 2, 2)
    with pytest.raises(ConfigError, match="deadlock"):
        simulate(_Deadlock(), 2, 2)


def test_registry() -> None:
    assert {"gpipe", "1f1b"} <= set(available_schedules())
    with pytest.raises(ConfigError, match="unknown schedule"):
        get_schedule("zero-bubble")
    with pytest.raises(ConfigError, match="num_micro_batches"):
        get_schedule("gpipe").actions(0, 2, 0)
