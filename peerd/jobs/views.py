"""A job as one daemon knows it (``JobEntry``), its state from public records, and its JSON views.

The views serve ``peerd status`` / ``peerd jobs`` / the metrics endpoint. ``progress_summary``
folds the tasklets' progress records into the job's numbers: the step every tasklet has
completed, the loss curve of the last stage (mean over its replicas per step), the job's
throughput, and bytes on the wire by kind with what they would have been uncompressed.
Everything a view says comes from public records (the owner's job record, the commit that
records prove, the tasklets' progress) plus what this daemon sees of the swarm, so every peer
reports the same state, step and allocation. Reasons are sentences for volunteers:
``start_warnings`` and ``waiting_reason`` say why a job does not start, ``describe_failure``
says which peer, which stage and what happened when a tasklet stops.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from peerd.errors import ConfigError, ErrorCode
from peerd.jobs.planner import JobPlanner, commit_view
from peerd.jobs.records import (
    MAX_LOSS_POINTS,
    TERMINAL,
    JobRecord,
    JobState,
    Progress,
    TaskState,
    downsample,
)
from peerd.jobs.regime import activation_regime, visits_per_example
from peerd.jobs.rl.progress import summary as rl_summary
from peerd.jobs.roles import JobRunner
from peerd.jobs.spec import JobSpec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit

WIRE_KINDS = ("activations", "gradients", "averaging")
SHORT_PEER = 8  # trailing characters of a peer id in sentences (peerd status shows the same)


@dataclass
class JobEntry:
    """What this daemon knows and runs for one job."""

    record: JobRecord
    spec: JobSpec
    planner: JobPlanner | None = None
    planner_task: asyncio.Task | None = None
    runner: JobRunner | None = None
    commit: Commit | None = None
    progress: dict[str, Progress] = field(default_factory=dict)
    stored_at: float = 0.0  # owner only: when the record was last stored
    final_progress: bool = False  # progress read in full after the job ended: nothing changes any more
    final_reads: int = 0  # reads of the progress records since the job ended
    records_read: bool = (
        False  # the commit was looked up in the public records (a job this peer did not plan)
    )
    curve: dict[int, float] = field(default_factory=dict)  # every loss point seen (remember_curve)


def effective_state(entry: JobEntry, now: float) -> JobState:
    """The job's state from public records: the owner's word if final, else what the records show."""
    rec = entry.record
    if rec.state in TERMINAL:
        return rec.state
    if entry.commit is not None:
        tasklets = [p for p in entry.progress.values() if p.epoch == entry.commit.epoch]
        if any(p.state == TaskState.FAILED for p in tasklets):
            return JobState.FAILED
        allocated = set(entry.commit.allocation.devices)
        done = {p.peer for p in tasklets if p.state == TaskState.DONE}
        if allocated and allocated <= done:
            return JobState.DONE
        replanning = entry.planner is not None and entry.planner.replanning
        if replanning or any(p.state in (TaskState.RECOVERING, TaskState.LEFT) for p in tasklets):
            return JobState.RECOVERING
        return JobState.RUNNING
    return JobState.PLANNING if now >= rec.epoch0_start else JobState.PENDING


JOB_ID_MIN_PREFIX = 4
"""The shortest job-id prefix resolved: 16 bits, so a few hundred jobs rarely share one."""


def resolve_job_id(text: str, known: Any) -> str | None:
    """The known job id ``text`` names (the full id or a unique prefix); None if it names no known job.

    ``ConfigError`` for a prefix too short to resolve, or one that matches several jobs (naming them).
    """
    if text in known:
        return text
    if len(text) < JOB_ID_MIN_PREFIX:
        raise ConfigError(
            "job_id",
            f"prefix {text!r} is too short: give at least {JOB_ID_MIN_PREFIX} characters (peerd jobs lists the ids)",
        )
    matches = sorted(job_id for job_id in known if job_id.startswith(text))
    if len(matches) > 1:
        raise ConfigError("job_id", f"prefix {text!r} is ambiguous: it matches {', '.join(matches)}")
    return matches[0] if matches else None


def compression_by_kind(sent: dict[str, int]) -> dict[str, float]:
    """Raw fp32 bytes over wire bytes of each kind that went out (activations, backward gradients,
    averaging), from a progress record's byte counters."""
    return {kind: round(sent.get(f"{kind}_raw", 0) / sent[kind], 3) for kind in WIRE_KINDS if sent.get(kind)}


def spec_summary(spec: JobSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "kind": spec.kind,
        "model": spec.model.preset or f"hf {spec.model.family().name}",  # the config itself is in the spec
        "steps": spec.steps,
        "global_batch": spec.global_batch,
        "micro_batch": spec.micro_batch,
        "seq_len": spec.data.seq_len,
        "d_pp": spec.parallel.d_pp,
        "d_dp": spec.parallel.d_dp,
        "min_peers": spec.min_peers,
        "max_peers": spec.max_peers,
        "objective": spec.planning.objective,
        "compression": {
            "forward": spec.compression.forward,
            "forward_bits": spec.compression.forward_bits,
            "first_visit": spec.compression.first_visit_codec,
            "backward_bits": spec.compression.backward_bits,
            "gradient_bits": spec.compression.gradient_bits,
            "regime": regime.describe() if (regime := activation_regime(spec)) is not None else None,
        },
        "examples": spec.planning.examples,
        "visits_per_example": visits_per_example(spec),
    }


# -- reasons ---------------------------------------------------------------------------------------


def _peers(n: int, more: bool = False) -> str:
    return f"{n} {'more ' if more else ''}peer" + ("" if n == 1 else "s")


def start_warnings(spec: JobSpec, online: Collection[str]) -> list[str]:
    """What keeps ``spec`` from starting on the swarm this daemon sees (``online``: the ids of the
    online, profiled peers, this one included); ``peerd submit`` prints each line."""
    n, need = len(set(online)), spec.min_peers
    out = []
    if n < need:
        out.append(
            f"this swarm has {_peers(n)} online and the job needs min_peers {need}: it waits in "
            f"planning until {_peers(need - n, more=True)} join" + ("s" if need - n == 1 else "")
        )
    shape = spec.parallel.known()
    if spec.planning.objective == "dtfm" and len(shape) == 2:
        tasklets = shape["d_pp"] * shape["d_dp"]
        roster = n if spec.max_peers is None else min(n, spec.max_peers)
        if roster > tasklets:
            out.append(
                f"objective dtfm gives every roster peer a tasklet, but up to {roster} peers would join "
                f"a {shape['d_pp']} x {shape['d_dp']} job: set max_peers: {tasklets}, or use objective "
                "peerd (the extra peers wait as spares)"
            )
    return out


def waiting_reason(
    spec: JobSpec,
    *,
    online: Collection[str] | None,
    planning: dict[str, Any] | None,
    opens_in: float = 0.0,
) -> str:
    """Why a job without a commit is not training yet, as a sentence ("" when planning goes on normally).

    ``online``: the peers this daemon sees (None: unknown); ``planning``: ``JobPlanner.view()``,
    whose ``roster`` (``{"epoch", "peers"}``, the last frozen roster view) and islands' errors
    are used when present; ``opens_in``: seconds until planning epoch 0 opens.
    """
    need = spec.min_peers
    if online is not None and len(set(online)) < need:
        n = len(set(online))
        return f"waiting for {_peers(need - n, more=True)}: {n} of min_peers {need} are online"
    planning = planning or {}
    roster = planning.get("roster") or {}
    if roster.get("peers") is not None and roster["peers"] < need:
        n = int(roster["peers"])
        return (
            f"waiting for {_peers(need - n, more=True)}: the roster of planning epoch {roster.get('epoch', 0)} "
            f"had {n} of min_peers {need}"
        )
    islands = planning.get("islands") or []
    if islands and islands[-1].get("error"):  # the latest epoch's search only: older ones are history
        last = islands[-1]
        return f"this peer's search in planning epoch {last.get('epoch', 0)} failed: {_clean(last['error'])}"
    if opens_in > 0:
        return f"planning opens in {opens_in:.0f} s"
    return ""


_CODE = re.compile(r"\s*\[([A-Z_]+)\]\s*$")
# what a libp2p / socket error appends after the sentence that matters
_RAW_TAIL = re.compile(
    r"(:\s*)?(failed to dial|all dials failed|dial tcp|dial backoff|Traceback|\n).*$", re.S
)
_MULTIADDR = re.compile(r"/(ip4|ip6|dns|dns4|dns6|tcp|udp|quic|quic-v1|p2p|ws)/\S*")


def _clean(text: str, ids: Collection[str] = ()) -> str:
    """One short sentence of an error text: no code suffix, multiaddrs, dial details or full peer ids."""
    text = _CODE.sub("", text)
    text = _RAW_TAIL.sub("", text)
    text = _MULTIADDR.sub("", text)
    for peer in sorted(ids, key=len, reverse=True):
        text = text.replace(peer, f"…{peer[-SHORT_PEER:]}")
    text = " ".join(text.split()).strip(" :;,.")
    return text[:157] + "..." if len(text) > 160 else text


def _where(allocation: Allocation | None, peer: str) -> tuple[int, int] | None:
    for s, stage in enumerate(allocation.stages if allocation is not None else ()):
        if peer in stage:
            return s, stage.index(peer)
    return None


def _partner(p: Progress, allocation: Allocation | None, message: str) -> str:
    """The partner the error names (or the tasklet suspects), described by its place in the pipeline."""
    known = [*(allocation.devices if allocation else []), *(allocation.spares if allocation else [])]
    named = [d for d in dict.fromkeys([*known, *p.suspects]) if d != p.peer and d in message]
    peer = named[0] if named else next((d for d in p.suspects if d != p.peer), None)
    if peer is None:
        return ""
    short = f"…{peer[-SHORT_PEER:]}"
    where = _where(allocation, peer)
    if where is None:
        return f"peer {short}"
    stage = where[0]
    if stage == p.stage - 1:
        return f"its previous stage's peer {short} (stage {stage})"
    if stage == p.stage + 1:
        return f"its next stage's peer {short} (stage {stage})"
    if stage == p.stage:
        return f"its replica partner {short} in stage {stage}"
    return f"peer {short} (stage {stage})"


def describe_failure(p: Progress, allocation: Allocation | None = None) -> str:
    """A tasklet's progress record as a sentence: which peer, which stage, what happened.

    The record's ``reason`` is the error text the tasklet stopped on (``message [CODE]``); its
    code picks the sentence, the partner it names (or ``suspects``) is described by its place
    in ``allocation``, and raw transport details (multiaddrs, dial errors) are left out.
    """
    who = f"stage {p.stage} replica {p.replica} (peer …{p.peer[-SHORT_PEER:]})"
    if p.state == TaskState.DONE:
        return f"{who} finished all {p.steps} steps"
    if p.state == TaskState.LEFT:
        return f"{who} left the swarm at step {p.step}; its tasklet was handed over"
    if p.state == TaskState.RUNNING:
        return f"{who} is training (step {p.step})"
    found = _CODE.search(p.reason)
    code = ErrorCode.__members__.get(found.group(1)) if found else None
    partner = _partner(p, allocation, p.reason)
    ids = [*(allocation.devices if allocation else []), *p.suspects, p.peer]
    detail = _clean(p.reason, ids)
    if p.reason.startswith("stopped"):
        what = "was stopped: the job was cancelled or its daemon shut down"
    elif code == ErrorCode.TIMEOUT and "did not start" in p.reason:
        what = (
            f"waited in vain for {partner or 'its partners'} to start {'its' if partner else 'their'} tasklet"
        )
    elif code == ErrorCode.TIMEOUT:
        what = f"heard nothing from {partner or 'a partner'} in time"
    elif code == ErrorCode.PEER_UNAVAILABLE:
        what = f"lost its connection to {partner}" if partner else "lost the connection to a partner"
    elif code == ErrorCode.NON_FINITE:
        what = "stopped because training diverged (NaN or infinite values)"
    elif code == ErrorCode.CONFIG_INVALID:
        what = f"could not start ({detail})" if detail else "could not start"
    elif code is not None and 500 <= code < 700:
        source = f" from {partner}" if partner else ""
        what = f"received data{source} it could not use ({detail})"
    else:
        what = f"stopped on an error ({detail})" if detail else "stopped on an error"
    if p.state == TaskState.RECOVERING:
        return f"{who} is recovering after step {p.step}: it {what}"
    return f"{who} {what} at step {p.step}"


def failure_reason(entry: JobEntry) -> str:
    """The sentence for a failed job: its first failed tasklet of the committed epoch ("" if none)."""
    commit = entry.commit
    if commit is None:
        return ""
    failed = sorted(
        (p for p in entry.progress.values() if p.epoch == commit.epoch and p.state == TaskState.FAILED),
        key=lambda p: (p.stage, p.replica, p.peer),
    )
    return describe_failure(failed[0], commit.allocation) if failed else ""


def job_reason(entry: JobEntry, state: JobState, now: float, online: Collection[str] | None = None) -> str:
    """The reason a view shows beside ``state``: a failure's sentence, why planning waits, or the owner's word."""
    rec = entry.record
    if state == JobState.FAILED:
        return failure_reason(entry) or _clean(rec.reason)
    if rec.reason:
        return rec.reason
    if state == JobState.RECOVERING:
        return recovery_reason(entry, online)
    if state in (JobState.PENDING, JobState.PLANNING) and entry.commit is None:
        planning = entry.planner.view() if entry.planner is not None else None
        return waiting_reason(entry.spec, online=online, planning=planning, opens_in=rec.epoch0_start - now)
    return ""


def recovery_reason(entry: JobEntry, online: Collection[str] | None = None) -> str:
    """Why a running job is recovering: the re-plan's cause, and what it waits for when it cannot go on."""
    planner, commit = entry.planner, entry.commit
    replans = planner.replans if planner is not None else []
    cause = _clean(replans[-1]["cause"]) if replans else ""
    if planner is not None and planner.replanning:
        view = planner.view()
        waiting = waiting_reason(entry.spec, online=online, planning=view)
        if not waiting and view.get("rejected", {}).get("no_repair"):
            waiting = "waiting for peers: no roster since then can hold every stage of the running pipeline"
        head = f"re-planning after: {cause}" if cause else "re-planning"
        return f"{head}; {waiting}" if waiting else head
    if commit is not None:
        loading = [
            p for p in entry.progress.values() if p.epoch == commit.epoch and p.state == TaskState.RECOVERING
        ]
        if loading:
            return f"restoring state at step {min(p.step for p in loading)} in planning epoch {commit.epoch}"
    return cause


def loss_curve(
    records: Iterable[Progress], *, last_stage: int, held_out: bool = False
) -> list[tuple[int, float]]:
    """The job's loss per step: the mean over the last stage's replicas, from records of every epoch.

    ``held_out``: the held-out loss curve instead (``val_losses``: per steps completed; the
    replicas evaluate equal shards of one held-out set, so their mean is that set's loss).

    After a re-plan a step's loss may sit in the record of a peer that is gone (the steps
    before its death) or of its successor (the steps after). Per step, the records of the
    newest epoch that lists it count, and only those: a record lists the steps before its
    epoch's resume step as the job's values (``carried_losses``), so averaging them with an
    older epoch's per-replica values would mix a mean into a mean. A step counts once every
    replica of that epoch (its records say how many there are) has completed it and every one
    whose record reaches back to it lists it: a replica that joined at a re-plan lists only the
    steps since (or the ones it inherited), so the steps before a growth stay on the curve,
    while a step one replica's downsampled record skipped is left out rather than shown as a
    partial mean. Held-out points are carried as each replica's own shard's loss, so for them
    per (step, replica) the newest epoch's record counts and their mean is the set's loss.
    """
    best: dict[tuple[int, int], tuple[int, float]] = {}  # (step, replica) -> (epoch, loss)
    width: dict[int, int] = {}  # epoch -> replicas of the last stage seen in its records
    # epoch -> replica -> (first point listed, steps completed: the last point for held-out)
    span: dict[int, dict[int, tuple[int, int]]] = {}
    for p in records:
        if p.stage != last_stage:
            continue
        width[p.epoch] = max(width.get(p.epoch, 0), p.replicas, p.replica + 1)
        points = p.val_losses if held_out else p.losses
        if points:
            end = points[-1][0] if held_out else p.step - 1  # the newest point it must have
            span.setdefault(p.epoch, {})[p.replica] = (points[0][0], end)
        for s, loss in points:
            seen = best.get((s, p.replica))
            if seen is None or p.epoch > seen[0]:
                best[(s, p.replica)] = (p.epoch, loss)
    per_step: dict[int, dict[int, tuple[int, float]]] = {}
    for (s, replica), value in best.items():
        per_step.setdefault(s, {})[replica] = value
    curve = []
    for s, values in sorted(per_step.items()):
        epoch = max(e for e, _ in values.values())
        if not held_out:  # carried training losses are the job's: the newest epoch's alone count
            values = {r: value for r, value in values.items() if value[0] == epoch}
        replicas = span.get(epoch, {})
        reached = len(replicas) >= width.get(epoch, 0) and all(end >= s for _, end in replicas.values())
        listed = all(r in values for r, (first, _) in replicas.items() if first <= s)
        if reached and listed:
            curve.append((s, sum(loss for _, loss in values.values()) / len(values)))
    return curve


def merge_final_records(held: dict[str, Progress], read: dict[str, Progress]) -> dict[str, Progress]:
    """An ended job's records: per peer the newer of what this daemon held and what a read found
    (a read after the end may miss a record that DHT propagation has not brought yet)."""
    out = dict(held)
    for peer, p in read.items():
        mine = out.get(peer)
        if mine is None or p.recency >= mine.recency:
            out[peer] = p
    return out


def records_complete(
    progress: dict[str, Progress], epoch: int, allocation: Allocation, state: JobState
) -> bool:
    """Whether ``progress`` holds the last record of every tasklet of an ended job's ``allocation``:
    one of ``epoch`` for each, and for a done job a done one (the owner saw those; an earlier
    record of the same epoch, which a lagging DHT read may still return, lacks the final figures)."""
    have = {
        (p.stage, p.replica)
        for p in progress.values()
        if p.epoch == epoch and (state != JobState.DONE or p.state == TaskState.DONE)
    }
    return all((s, r) in have for s in range(allocation.d_pp) for r in range(allocation.d_dp))


CURVE_MEMORY = 4 * MAX_LOSS_POINTS
"""Loss points a daemon remembers per job (downsampled beyond it)."""


def remember_curve(entry: JobEntry) -> None:
    """Add the loss curve the job's records show now to ``entry.curve``.

    A re-plan can replace the only record that carried the early steps (the last stage's peer
    left, or moved to another stage); the tasklet that takes the last stage over inherits
    them from its daemon's memory (``TaskletRunner.adopt``), so they stay on the public curve.
    """
    stages = [p.stage for p in entry.progress.values() if p.losses]
    if not stages:
        return
    entry.curve.update(loss_curve(entry.progress.values(), last_stage=max(stages)))
    if len(entry.curve) > CURVE_MEMORY:
        entry.curve = dict(downsample(sorted(entry.curve.items()), CURVE_MEMORY))


def progress_summary(progress: dict[str, Progress], epoch: int | None, steps: int) -> dict[str, Any]:
    """The job's progress from its tasklets' records (only those of the committed ``epoch``)."""
    tasklets = [p for p in progress.values() if epoch is None or p.epoch == epoch]
    out: dict[str, Any] = {
        "steps": steps,
        "step": 0,
        "loss": None,
        "losses": [],
        "val_loss": None,
        "val_losses": [],
        "tokens_per_s": None,
        "rl": None,
    }
    if not tasklets:
        out.update(bytes={}, tasklets=[])
        return out
    out["step"] = min(p.step for p in tasklets)
    curve = loss_curve(progress.values(), last_stage=max(p.stage for p in tasklets))
    out["losses"] = [[s, round(v, 6)] for s, v in curve]
    out["loss"] = curve[-1][1] if curve else None
    held_out = loss_curve(progress.values(), last_stage=max(p.stage for p in tasklets), held_out=True)
    out["val_losses"] = [[k, round(v, 6)] for k, v in held_out]
    out["val_loss"] = held_out[-1][1] if held_out else None
    rates = [p.tokens_per_s for p in tasklets if p.tokens_per_s > 0]
    out["tokens_per_s"] = median(rates) if rates else None
    out["rl"] = rl_summary(tasklets)  # an rl job's trainer: GRPO's figures (None for other jobs)
    totals: dict[str, int] = {}
    for p in tasklets:
        for kind, n in p.bytes.items():
            totals[kind] = totals.get(kind, 0) + n
    out["bytes"] = totals
    wire = sum(totals.get(k, 0) for k in WIRE_KINDS)
    raw = sum(totals.get(f"{k}_raw", 0) for k in WIRE_KINDS)
    out["compression_ratio"] = round(raw / wire, 3) if wire else None
    out["compression_by_kind"] = compression_by_kind(totals)
    out["tasklets"] = [
        {
            "peer": p.peer,
            "stage": p.stage,
            "replica": p.replica,
            "step": p.step,
            "state": p.state.value,
            "tokens_per_s": p.tokens_per_s,
            "reason": p.reason,
        }
        for p in sorted(tasklets, key=lambda p: (p.stage, p.replica))
    ]
    return out


def job_view(
    entry: JobEntry, me: str, now: float, *, detail: bool, online: Collection[str] | None = None
) -> dict[str, Any]:
    """One job as ``peerd jobs`` lists it (``detail``: as ``peerd job status`` shows it).

    ``online``: the peers this daemon sees (for the reason a job waits; None: not said). The
    allocation and step come from the commit and progress records, whether or not this daemon
    planned or ran the job.
    """
    rec = entry.record
    state = effective_state(entry, now)
    view: dict[str, Any] = {
        "job_id": rec.job_id,
        "short_id": rec.job_id[:8],
        "name": entry.spec.name,
        "owner": rec.owner,
        "owner_is_me": rec.owner == me,
        "state": state.value,
        "record_state": rec.state.value,
        "reason": job_reason(entry, state, now, online),
        "created_at": rec.created_at,
        "epoch0_start": rec.epoch0_start,
        "spec": spec_summary(entry.spec),
    }
    commit = entry.commit
    planner = entry.planner
    if commit is not None:
        regions = planner.regions if planner is not None else {}
        allocation = commit_view(commit)
        allocation["regions"] = {p: regions.get(p, "") for p in commit.allocation.devices}
        view["allocation"] = allocation
    if planner is not None and detail:
        view["planning"] = planner.view()
    if detail:
        view["spec_mapping"] = rec.spec
    progress = progress_summary(entry.progress, commit.epoch if commit else None, entry.spec.steps)
    if state in TERMINAL and not progress["tasklets"]:
        progress["step"] = None  # no tasklet record left to say how far it got: unknown, not 0
    view["progress"] = progress
    view["churn"] = churn_view(entry)
    if entry.runner is not None:
        view["tasklet"] = {
            "stage": entry.runner.stage,
            "replica": entry.runner.replica,
            "state": entry.runner.state.value,
            "step": entry.runner.step,
            "recoveries": list(entry.runner.recoveries),
            "phases_s": {k: round(v, 6) for k, v in entry.runner.phases().items()},
            "s_per_step": entry.runner.s_per_step(),
        }
    return view


def churn_view(entry: JobEntry) -> dict[str, Any]:
    """Re-plans (epoch, cause), suspected peers and spares, as this daemon sees them."""
    commit, planner = entry.commit, entry.planner
    suspects = sorted(
        {s for p in entry.progress.values() if commit is None or p.epoch == commit.epoch for s in p.suspects}
    )
    return {
        "epoch": commit.epoch if commit is not None else None,
        "replans": list(planner.replans) if planner is not None else [],
        "replanning": bool(planner is not None and planner.replanning),
        "suspects": suspects,
        "spares": list(commit.allocation.spares) if commit is not None else [],
    }
