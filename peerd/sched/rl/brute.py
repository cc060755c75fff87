"""Brute force for tiny instances: every grouping x every device -> group labelling (idle allowed).

Device-level on purpose: it checks the class reduction the other searches rely on as well as
their optimum. (g + 1)^N labellings per grouping of g groups, so keep N <= ~7.
"""

from __future__ import annotations

import itertools

from peerd.errors import ConfigError
from peerd.sched.rl.evaluate import Counts, Evaluator, Grouping, Score
from peerd.sched.rl.hybrid import counts_of

MAX_DEVICES = 8


def brute_force(ev: Evaluator, max_groups: int = 3) -> tuple[Grouping, tuple[Counts, ...], Score]:
    """The best plan of all; ties go to the first in enumeration order."""
    n = ev.cluster.n
    if n > MAX_DEVICES:
        raise ConfigError("devices", f"brute force is for at most {MAX_DEVICES} devices, got {n}")
    best: tuple[Grouping, tuple[Counts, ...], Score] | None = None
    for grouping in ev.workflow.groupings(max_groups):
        m = len(grouping)
        for labels in itertools.product(range(-1, m), repeat=n):
            if any(g not in labels for g in range(m)):
                continue
            counts = counts_of(ev, list(labels), m)
            score = ev.score(grouping, counts)
            if best is None or score.key < best[2].key - 1e-12:
                best = (grouping, tuple(counts), score)
    assert best is not None, "the single group of every device is always enumerated"
    return best
