"""Where a re-planned job resumes, and from whom each tasklet takes its stage's state: pure functions of the roster.

The committed roster's entries list the stage state each member holds (``HeldState``: a
stage, its layer range, the steps it can serve: its live step, its rollback step, its
checkpoints). All tasklets of the new allocation resume from one step, the **resume
step**: the newest step that, for every stage, some member holds (step 0 is always
available: every peer builds the same initial weights from the job's seed). Every peer
computes it from the same committed roster, so they agree without talking.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import MAX_HELD_STEPS, HeldState, RosterEntry

CHECKPOINT_REPLICAS = 2
"""Peers outside a stage that keep copies of each of its checkpoints (``replica_peers``)."""


def target_width(d_dp: int | str, max_peers: int | None, d_pp: int) -> int | None:
    """The replicas a job asks for at ``d_pp`` stages: a fixed ``d_dp``, else as many as ``max_peers``
    allows; None when ``auto`` and uncapped. A job that shrank after failures grows back towards it."""
    if isinstance(d_dp, int):
        return d_dp
    return max_peers // d_pp if max_peers else None


def stage_layers(layers_per_stage: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) layer range of each stage for a per-stage layer count."""
    out, start = [], 0
    for n in layers_per_stage:
        out.append((start, start + n))
        start += n
    return out


def held_state(stage: int, layers: tuple[int, int], steps: Iterable[int]) -> HeldState:
    """A ``HeldState`` for a roster entry: the newest ``MAX_HELD_STEPS`` steps, ascending."""
    newest = sorted(set(steps))[-MAX_HELD_STEPS:]
    return HeldState(stage, layers, tuple(newest))


def resume_step(roster: Sequence[RosterEntry], layers: Sequence[tuple[int, int]]) -> int:
    """The newest step some member of ``roster`` holds for every stage (layer ranges ``layers``); 0 if none."""
    common: set[int] | None = None
    for stage, span in enumerate(layers):
        steps = {0}
        for entry in roster:
            for h in entry.held:
                if h.stage == stage and tuple(h.layers) == tuple(span):
                    steps.update(h.steps)
        common = steps if common is None else common & steps
    return max(common) if common else 0


def holders(
    roster: Sequence[RosterEntry], stage: int, span: tuple[int, int], step: int, *, job: str
) -> list[str]:
    """Members holding ``stage`` (layers ``span``) at ``step``, in an order every peer derives alike.

    Ordered by a hash of (job, step, peer), so different jobs and steps spread their
    transfers over different holders instead of all asking the lowest peer id.
    """
    found = [
        e.peer
        for e in roster
        if any(h.stage == stage and tuple(h.layers) == tuple(span) and step in h.steps for h in e.held)
    ]
    return sorted(found, key=lambda p: hashlib.sha256(f"{job}|{step}|{p}".encode()).digest())


def replica_peers(job: str, allocation: Allocation, stage: int, k: int) -> list[str]:
    """The ``k`` peers outside ``stage`` (spares included) that keep copies of its checkpoints.

    Ranked by a hash of (job, stage, peer): every peer derives the same ones, and different
    stages spread their copies over different peers.
    """
    members = set(allocation.stages[stage])
    others = [p for p in (*allocation.devices, *allocation.spares) if p not in members]
    ranked = sorted(others, key=lambda p: hashlib.sha256(f"{job}|{stage}|{p}".encode()).digest())
    return ranked[:k]


def patch_allocation(
    previous: Allocation, roster: Sequence[RosterEntry], widths: Sequence[int]
) -> list[Allocation]:
    """Repairs of ``previous`` on ``roster``, widest first: survivors keep their slots, holes get free peers.

    For each data-parallel width in ``widths`` (at most ``previous.d_dp`` are used as they
    are; narrower ones drop the replicas with the most holes first, wider ones add columns)
    the holes are filled with the free roster peers, fastest device first. Widths that
    cannot be filled are skipped. The layer split is kept: the stages' state must still fit.
    """
    alive = {e.peer: e for e in roster}
    free_all = sorted(
        (p for p in alive if p not in set(previous.devices)),
        key=lambda p: (-alive[p].profile.tflops, p),
    )
    out = []
    for width in widths:
        ranked = sorted(previous.pipelines(), key=lambda col: sum(p not in alive for p in col))  # stable
        columns = [list(col) for col in ranked[:width]]
        columns += [[""] * previous.d_pp for _ in range(width - len(columns))]
        dropped = [p for col in ranked[width:] for p in col if p in alive]  # survivors of dropped replicas
        free = list(free_all) + dropped
        holes = sum(p not in alive for col in columns for p in col)
        if holes > len(free):
            continue
        for col in columns:
            for k, p in enumerate(col):
                if p not in alive:
                    col[k] = free.pop(0)
        stages = [[col[k] for col in columns] for k in range(previous.d_pp)]
        out.append(Allocation.from_plain(stages, free, previous.layers))
    return out


def cheapest_repair(
    scored: Sequence[tuple[float, Allocation]], width: int, margin: float
) -> tuple[float, Allocation]:
    """The cheapest of the (cost, repair) pairs; one wider than the running ``width`` only if it is
    cheaper than the repair at ``width`` by more than ``margin`` (a fraction): growing costs a re-plan."""
    cost, choice = min(scored, key=lambda ca: ca[0])
    same = next(((c, a) for c, a in scored if a.d_dp == width), None)
    if choice.d_dp > width and same is not None and cost > same[0] * (1 - margin):
        return same
    return cost, choice
