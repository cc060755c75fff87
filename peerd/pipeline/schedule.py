"""Micro-batch schedules (GPipe, 1F1B) as strategies, and a checker that runs them as message passing.

A schedule gives each stage the order of its forward and backward passes over ``M`` micro-batches;
``actions`` expands that into the stage's full action list with the receives and sends around
each pass. ``simulate`` executes all stages' lists together with blocking receives and buffered
sends (how the stage worker behaves), so it finds deadlocks and dependency violations, and it
reports the peak number of micro-batches whose activations a stage holds (the memory 1F1B bounds).
Its event order is also a valid single-process execution order (``peerd.pipeline.local``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from peerd.errors import ConfigError


class Op(enum.Enum):
    RECV_ACT = "recv_act"  # activations of a micro-batch from the previous stage
    FORWARD = "forward"
    SEND_ACT = "send_act"  # to the next stage
    RECV_GRAD = "recv_grad"  # gradient w.r.t. our output, from the next stage
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"  # gradient w.r.t. our input, to the previous stage


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int  # micro-batch index within the step

    def __str__(self) -> str:
        return f"{self.op.value}({self.mb})"


class Schedule(ABC):
    """A micro-batch schedule; subclasses only decide the order of forward and backward passes."""

    name: ClassVar[str]

    @abstractmethod
    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        """(FORWARD | BACKWARD, micro-batch) pairs in the order stage ``stage`` runs them."""

    def actions(self, stage: int, num_stages: int, num_micro: int) -> list[Action]:
        """Stage ``stage``'s full action list, with receives before and sends after each pass."""
        _check_sizes(stage, num_stages, num_micro)
        first, last = stage == 0, stage == num_stages - 1
        out: list[Action] = []
        for op, mb in self.compute_order(stage, num_stages, num_micro):
            if op is Op.FORWARD:
                out += ([] if first else [Action(Op.RECV_ACT, mb)]) + [Action(Op.FORWARD, mb)]
                out += [] if last else [Action(Op.SEND_ACT, mb)]
            elif op is Op.BACKWARD:
                out += ([] if last else [Action(Op.RECV_GRAD, mb)]) + [Action(Op.BACKWARD, mb)]
                out += [] if first else [Action(Op.SEND_GRAD, mb)]
            else:
                raise ConfigError("schedule", f"{self.name}: compute_order may only hold FORWARD/BACKWARD")
        return out


_SCHEDULES: dict[str, type[Schedule]] = {}


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _SCHEDULES:
        raise ValueError(f"schedule {cls.name!r} registered twice")
    _SCHEDULES[cls.name] = cls
    return cls


def get_schedule(name: str) -> Schedule:
    if name not in _SCHEDULES:
        raise ConfigError("schedule", f"unknown schedule {name!r} (known: {', '.join(sorted(_SCHEDULES))})")
    return _SCHEDULES[name]()


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def _check_sizes(stage: int, num_stages: int, num_micro: int) -> None:
    if num_stages < 1:
        raise ConfigError("num_stages", f"must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ConfigError("stage", f"must be in 0..{num_stages - 1}, got {stage}")
    if num_micro < 1:
        raise ConfigError("num_micro_batches", f"must be >= 1, got {num_micro}")


@register_schedule
class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al. 2019): holds all M micro-batches' activations."""

    name = "gpipe"

    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        return [(Op.FORWARD, i) for i in range(num_micro)] + [(Op.BACKWARD, i) for i in range(num_micro)]


@register_schedule
class OneFOneB(Schedule):
    """1F1B (PipeDream-flush, Narayanan et al. 2021): after a warm-up of ``S - s - 1`` forwards,
    alternate one forward and one backward, so stage ``s`` holds at most ``min(S - s, M)``
    micro-batches' activations instead of ``M``; same bubble as GPipe."""

    name = "1f1b"

    def compute_order(self, stage: int, num_stages: int, num_micro: int) -> list[tuple[Op, int]]:
        warmup = min(num_stages - stage - 1, num_micro)
        order = [(Op.FORWARD, i) for i in range(warmup)]
        for j in range(num_micro - warmup):
            order += [(Op.FORWARD, warmup + j), (Op.BACKWARD, j)]
        order += [(Op.BACKWARD, j) for j in range(num_micro - warmup, num_micro)]
        return order


@dataclass(frozen=True)
class Simulation:
    events: list[tuple[int, Action]]  # (stage, action) in a dependency-respecting global order
    peak_in_flight: list[int]  # per stage: most micro-batches forwarded but not yet backwarded
    rounds: int  # lock-step rounds (one action per ready stage per round) until all finished


def simulate(schedule: Schedule, num_stages: int, num_micro: int) -> Simulation:
    """Run every stage's action list as message passing; raise ``ConfigError`` if the schedule is
    invalid (a pass missing or repeated, an action before its dependency, or a deadlock)."""
    lists = [schedule.actions(s, num_stages, num_micro) for s in range(num_stages)]
    for s, acts in enumerate(lists):
        for op in (Op.FORWARD, Op.BACKWARD):
            mbs = sorted(a.mb for a in acts if a.op is op)
            if mbs != list(range(num_micro)):
                raise ConfigError("schedule", f"{schedule.name}: stage {s} runs {op.value} on {mbs}")
    pos = [0] * num_stages
    done: set[tuple[int, Op, int]] = set()
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    events: list[tuple[int, Action]] = []
    rounds = 0
    while any(pos[s] < len(lists[s]) for s in range(num_stages)):
        rounds += 1
        progressed = False
        for s in range(num_stages):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            if not _ready(s, a, done, num_stages):
                continue
            for need in _local_needs(s, a, num_stages):
                if need not in done:
                    raise ConfigError(
                        "schedule", f"{schedule.name}: stage {s} runs {a} before {need[1].value}"
                    )
            done.add((s, a.op, a.mb))
            events.append((s, a))
            pos[s] += 1
            progressed = True
            if a.op is Op.FORWARD:
                in_flight[s] += 1
                peak[s] = max(peak[s], in_flight[s])
            elif a.op is Op.BACKWARD:
                in_flight[s] -= 1
        if not progressed:
            stuck = {s: str(lists[s][pos[s]]) for s in range(num_stages) if pos[s] < len(lists[s])}
            raise ConfigError("schedule", f"{schedule.name}: deadlock, stages waiting at {stuck}")
    return Simulation(events, peak, rounds)


def _ready(s: int, a: Action, done: set[tuple[int, Op, int]], num_stages: int) -> bool:
    """Whether a blocking receive has its message; every other action is always ready."""
    if a.op is Op.RECV_ACT:
        return (s - 1, Op.SEND_ACT, a.mb) in done
    if a.op is Op.RECV_GRAD:
        return (s + 1, Op.SEND_GRAD, a.mb) in done
    return True


def _local_needs(s: int, a: Action, num_stages: int) -> list[tuple[int, Op, int]]:
    """What must already have happened on stage ``s`` before action ``a``."""
    first, last = s == 0, s == num_stages - 1
    if a.op is Op.FORWARD:
        return [] if first else [(s, Op.RECV_ACT, a.mb)]
    if a.op is Op.SEND_ACT:
        return [(s, Op.FORWARD, a.mb)]
    if a.op is Op.BACKWARD:
        return [(s, Op.FORWARD, a.mb)] + ([] if last else [(s, Op.RECV_GRAD, a.mb)])
    if a.op is Op.SEND_GRAD:
        return [(s, Op.BACKWARD, a.mb)]
    return []
