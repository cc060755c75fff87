"""GRPO and PPO as task graphs; task groupings (which tasks share devices) and the paths that time an iteration.

Tasks of one iteration and their data dependencies (``a -> b``: b needs a's output)::

    generate -> reference, reward, critic_infer, actor_train, critic_train
    reference -> actor_train            reward -> actor_train, critic_train
    critic_infer -> actor_train, critic_train
    actor_train -> (weight sync) -> next generate

GRPO has no critic tasks; ``reward`` exists only when the workload has a reward model.
Scheduling atoms ("units") are tasks that must share devices: PPO's critic inference and
training sit together, because the critic's weights are not synced between groups.

Tasks of one group run one after another in ``TASK_ORDER`` (time-sharing). Adding an edge
between consecutive tasks of each group to the dependency graph gives a DAG whose longest
path (task durations plus transfers between groups) is the synchronous iteration time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from peerd.sched.rl.workload import Workload

TASK_ORDER = ("generate", "reference", "reward", "critic_infer", "actor_train", "critic_train")
ROLE = {
    "generate": "actor",
    "reference": "reference",
    "reward": "reward",
    "critic_infer": "critic",
    "actor_train": "actor",
    "critic_train": "critic",
}
KIND = {
    "generate": "generate",
    "reference": "infer",
    "reward": "infer",
    "critic_infer": "infer",
    "actor_train": "train",
    "critic_train": "train",
}
# Data dependencies and what crosses them: "tokens" (prompt + response ids) or "scores" (per-token floats).
EDGES = (
    ("generate", "reference", "tokens"),
    ("generate", "reward", "tokens"),
    ("generate", "critic_infer", "tokens"),
    ("generate", "actor_train", "tokens"),
    ("generate", "critic_train", "tokens"),
    ("reference", "actor_train", "scores"),
    ("reward", "actor_train", "scores"),
    ("reward", "critic_train", "scores"),
    ("critic_infer", "actor_train", "scores"),
    ("critic_infer", "critic_train", "scores"),
)
SYNC = "weight_sync"
"""Pseudo-task after ``actor_train``: the new actor weights reach the generators."""


@dataclass(frozen=True)
class Workflow:
    """The tasks of one workload and its scheduling units."""

    tasks: tuple[str, ...]
    units: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, workload: Workload) -> Workflow:
        units: list[tuple[str, ...]] = [("generate",), ("reference",)]
        if workload.reward is not None:
            units.append(("reward",))
        if workload.algo == "ppo":
            units.append(("critic_infer", "critic_train"))
        units.append(("actor_train",))
        tasks = tuple(t for t in TASK_ORDER if any(t in u for u in units))
        return cls(tasks=tasks, units=tuple(units))

    @cached_property
    def edges(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(e for e in EDGES if e[0] in self.tasks and e[1] in self.tasks)

    def groupings(self, max_groups: int) -> list[tuple[tuple[str, ...], ...]]:
        """Every partition of the units into at most ``max_groups`` groups (tasks in ``TASK_ORDER``).

        Deterministic order: fewer groups first, then lexicographic in the units' order.
        """
        out = []
        for parts in _partitions(list(range(len(self.units)))):
            if len(parts) > max_groups:
                continue
            groups = tuple(
                tuple(t for t in TASK_ORDER if any(t in self.units[u] for u in part)) for part in parts
            )
            out.append(groups)
        out.sort(key=lambda g: (len(g), [[TASK_ORDER.index(t) for t in grp] for grp in g]))
        return out


@dataclass(frozen=True)
class Path:
    """One source-to-sink path of the timing DAG: its tasks, the transfers it crosses, whether it ends in a sync."""

    tasks: tuple[str, ...]
    transfers: tuple[tuple[int, int, str], ...]
    """(from group, to group, payload) of each dependency edge on the path that joins two groups."""
    sync: bool
    cycle: bool = False
    """A prefix ending at ``actor_train`` (+ sync): the loop back to the next generation, which async
    mode spreads over k + 1 iterations."""


def timing_paths(workflow: Workflow, groups: tuple[tuple[str, ...], ...]) -> list[Path]:
    """Every maximal path of the timing DAG of ``groups`` (dependency edges + each group's task chain).

    Every prefix ending in ``actor_train`` also appears as a ``cycle`` path, extended by the weight
    sync when generation and actor training sit in different groups. Small (tens of paths): the
    MILP gets one constraint each.
    """
    where = {t: g for g, grp in enumerate(groups) for t in grp}
    succ: dict[str, list[tuple[str, str | None]]] = {t: [] for t in workflow.tasks}
    for a, b, payload in workflow.edges:
        succ[a].append((b, payload if where[a] != where[b] else None))
    for grp in groups:
        for a, b in itertools.pairwise(grp):
            if all(b != s for s, _ in succ[a]):
                succ[a].append((b, None))
    synced = where["generate"] != where["actor_train"]
    out: list[Path] = []

    def walk(task: str, tasks: list[str], transfers: list[tuple[int, int, str]]) -> None:
        tasks = [*tasks, task]
        if task == "actor_train":
            out.append(Path(tuple(tasks), tuple(transfers), sync=synced, cycle=True))
        if not succ[task]:
            out.append(Path(tuple(tasks), tuple(transfers), sync=False))
        for nxt, payload in succ[task]:
            edge = [(where[task], where[nxt], payload)] if payload is not None else []
            walk(nxt, tasks, transfers + edge)

    walk("generate", [], [])
    return out


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Set partitions of ``items`` (restricted growth order)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
