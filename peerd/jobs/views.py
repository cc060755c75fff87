"""A job as one daemon knows it (``JobEntry``), its state from public records, and its JSON views.

The views serve ``peerd status`` / ``peerd jobs`` / the metrics endpoint. ``progress_summary``
folds the tasklets' progress records into the job's numbers: the step every tasklet has
completed, the loss curve of the last stage (mean over its replicas per step), the job's
throughput, and bytes on the wire by kind with what they would have been uncompressed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from peerd.errors import ConfigError
from peerd.jobs.planner import JobPlanner, commit_view
from peerd.jobs.records import TERMINAL, JobRecord, JobState, Progress, TaskState
from peerd.jobs.runner import TaskletRunner
from peerd.jobs.spec import JobSpec
from peerd.sched.consensus.actions import Commit

WIRE_KINDS = ("activations", "gradients", "averaging")


@dataclass
class JobEntry:
    """What this daemon knows and runs for one job."""

    record: JobRecord
    spec: JobSpec
    planner: JobPlanner | None = None
    planner_task: asyncio.Task | None = None
    runner: TaskletRunner | None = None
    runner_task: asyncio.Task | None = None
    commit: Commit | None = None
    progress: dict[str, Progress] = field(default_factory=dict)
    stored_at: float = 0.0  # owner only: when the record was last stored
    final_progress: bool = False  # progress read once after the job ended: nothing changes any more


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


def spec_summary(spec: JobSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "kind": spec.kind,
        "model": spec.model.preset or spec.model.hf,
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
            "backward_bits": spec.compression.backward_bits,
            "gradient_bits": spec.compression.gradient_bits,
        },
    }


def progress_summary(progress: dict[str, Progress], epoch: int | None, steps: int) -> dict[str, Any]:
    """The job's progress from its tasklets' records (only those of the committed ``epoch``)."""
    tasklets = [p for p in progress.values() if epoch is None or p.epoch == epoch]
    out: dict[str, Any] = {"steps": steps, "step": 0, "loss": None, "losses": [], "tokens_per_s": None}
    if not tasklets:
        out.update(bytes={}, tasklets=[])
        return out
    out["step"] = min(p.step for p in tasklets)
    last_stage = max(p.stage for p in tasklets)
    per_step: dict[int, list[float]] = {}
    for p in tasklets:
        if p.stage == last_stage:
            for s, loss in p.losses:
                per_step.setdefault(s, []).append(loss)
    replicas = max((len(v) for v in per_step.values()), default=0)
    curve = [(s, sum(v) / len(v)) for s, v in sorted(per_step.items()) if len(v) == replicas]
    out["losses"] = [[s, round(v, 6)] for s, v in curve]
    out["loss"] = curve[-1][1] if curve else None
    rates = [p.tokens_per_s for p in tasklets if p.tokens_per_s > 0]
    out["tokens_per_s"] = median(rates) if rates else None
    totals: dict[str, int] = {}
    for p in tasklets:
        for kind, n in p.bytes.items():
            totals[kind] = totals.get(kind, 0) + n
    out["bytes"] = totals
    wire = sum(totals.get(k, 0) for k in WIRE_KINDS)
    raw = sum(totals.get(f"{k}_raw", 0) for k in WIRE_KINDS)
    out["compression_ratio"] = round(raw / wire, 3) if wire else None
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


def job_view(entry: JobEntry, me: str, now: float, *, detail: bool) -> dict[str, Any]:
    """One job as ``peerd jobs`` lists it (``detail``: as ``peerd job status`` shows it)."""
    rec = entry.record
    view: dict[str, Any] = {
        "job_id": rec.job_id,
        "short_id": rec.job_id[:8],
        "name": entry.spec.name,
        "owner": rec.owner,
        "owner_is_me": rec.owner == me,
        "state": effective_state(entry, now).value,
        "record_state": rec.state.value,
        "reason": rec.reason,
        "created_at": rec.created_at,
        "epoch0_start": rec.epoch0_start,
        "spec": spec_summary(entry.spec),
    }
    commit = entry.commit
    planner = entry.planner
    if planner is not None:
        regions = planner.regions
        if commit is not None:
            allocation = commit_view(commit)
            allocation["regions"] = {p: regions.get(p, "") for p in commit.allocation.devices}
            view["allocation"] = allocation
        if detail:
            view["planning"] = planner.view()
    if detail:
        view["spec_mapping"] = rec.spec
    view["progress"] = progress_summary(entry.progress, commit.epoch if commit else None, entry.spec.steps)
    if entry.runner is not None:
        view["tasklet"] = {
            "stage": entry.runner.stage,
            "replica": entry.runner.replica,
            "state": entry.runner.state.value,
            "step": entry.runner.step,
        }
    return view
