"""Assemble a job's per-stage checkpoints into one model file: ``peerd.models.load_checkpoint(path)`` loads it.

Each tasklet checkpoints its own stage (``peerd.pipeline.checkpoint``: one directory per
stage replica, ``step-NNNNNNNN.pt`` files, the stage's layer range in ``meta.layers``).
``assemble`` picks the newest step for which every stage has a checkpoint (any replica: the
replicas of a stage hold identical weights after averaging), renames each stage's
``layers.k.*`` parameters to the full model's ``layers.(start + k).*``, checks the result
loads into the job's model (``peerd.models.registry``: the built-in GPT or a Hugging Face
family) exactly (no missing or unexpected keys, matching shapes) and writes ``model.pt``
(``peerd.models.checkpoint``: the model's description, weights, job, step) plus ``job.json``
(the spec). ``model.pt`` is self-contained: it loads without the spec, and a ``finetune``
job can name it (or its directory) as ``init_checkpoint``.

``gather`` gets those checkpoints over p2p instead, for a daemon that ran no tasklet of the
job: each stage's from the peers that ran it in the committed allocation or keep copies of
it (``recovery.replica_peers``), through the state-sync protocol, at the newest step every
stage has; the result is written in the same directory layout and assembled as above.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from peerd.durable import replace_file
from peerd.errors import ConfigError, PeerdError, PeerUnavailable
from peerd.jobs.recovery import CHECKPOINT_REPLICAS, replica_peers
from peerd.jobs.spec import JobSpec
from peerd.loading import to_mapping
from peerd.log import get_logger
from peerd.models.checkpoint import open_checkpoint, save_checkpoint
from peerd.models.stack import LayerStack
from peerd.models.weights import MODEL_FILE
from peerd.pipeline import checkpoint
from peerd.pipeline.replicas import check_checkpoint
from peerd.pipeline.statesync import StateProvider, StateSyncConfig, fetch_state
from peerd.sched.allocation import Allocation
from peerd.swarm.transport import Transport

logger = get_logger(__name__)

_DIR = re.compile(r"stage(\d+)-replica(\d+)")


@dataclass(frozen=True)
class Fetched:
    path: Path
    step: int
    stages: int
    parameters: int
    sources: list[str]  # the checkpoint file of each stage, in stage order


def _stage_dirs(roots: list[Path], job_id: str) -> dict[int, list[Path]]:
    found: dict[int, list[Path]] = {}
    for root in roots:
        job_dir = root / job_id
        if not job_dir.is_dir():
            continue
        for d in sorted(job_dir.iterdir()):
            m = _DIR.fullmatch(d.name)
            if m and d.is_dir():
                found.setdefault(int(m.group(1)), []).append(d)
    return found


def assemble(job_id: str, spec: JobSpec, roots: list[Path], out_dir: Path) -> Fetched:
    """Write ``out_dir/model.pt`` from the newest step all stages have; ConfigError when some stage is missing."""
    family = spec.model.family()
    dirs = _stage_dirs(roots, job_id)
    if not dirs:
        where = ", ".join(str(r) for r in roots) or "(no directory)"
        raise ConfigError("job_id", f"no checkpoints of job {job_id} under {where}")
    stages = max(dirs) + 1
    missing = [s for s in range(stages) if s not in dirs]
    if missing:
        raise ConfigError("job_id", f"no checkpoint of stage(s) {missing} of job {job_id} here")
    steps_of = [{step: d for d in dirs[s] for step in checkpoint.saved_steps(d)} for s in range(stages)]
    common = set.intersection(*(set(x) for x in steps_of))
    if not common:
        raise ConfigError("job_id", f"the stages of job {job_id} have no checkpointed step in common")
    step = max(common)
    state: dict[str, torch.Tensor] = {}
    sources, covered = [], []
    for s in range(stages):
        ck = checkpoint.load(steps_of[s][step], step)
        if ck["job"] != job_id or ck["stage"] != s:
            raise ConfigError("checkpoint_dir", f"{steps_of[s][step]} holds another job or stage")
        start, end = (int(x) for x in ck["meta"]["layers"])
        covered.append((start, end))
        for key, tensor in ck["module"].items():
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
            if m is None:
                raise ConfigError("checkpoint", f"unexpected parameter {key!r} in stage {s}")
            state[f"layers.{start + int(m.group(1))}.{m.group(2)}"] = tensor
        sources.append(str(checkpoint.checkpoint_file(steps_of[s][step], step)))
    starts = [0] + [end for _, end in covered[:-1]]
    if [start for start, _ in covered] != starts or covered[-1][1] != family.num_layers:
        raise ConfigError(
            "checkpoint", f"stage layer ranges {covered} do not tile the model's {family.num_layers} layers"
        )
    model = family.build()
    model.load_state_dict(state, strict=True)  # the file must load into the model class as is
    path = save_checkpoint(out_dir / MODEL_FILE, family, model.state_dict(), job=job_id, step=step)
    text = json.dumps({"job_id": job_id, "step": step, "spec": to_mapping(spec)}, indent=2)
    replace_file(out_dir / "job.json", lambda fh: fh.write(text.encode()))
    logger.info("job %s: assembled %d stages at step %d into %s", job_id, stages, step, path)
    return Fetched(path, step, stages, model.num_parameters(), sources)


def _writer(data: bytes) -> Callable[[BinaryIO], object]:
    return lambda fh: fh.write(data)


async def gather(
    transport: Transport,
    peer_ref: Callable[[str], Any],
    job_id: str,
    allocation: Allocation,
    steps: list[int],
    dest: Path,
    *,
    me: str,
    max_bytes: int,
    local: StateProvider | None = None,
    config: StateSyncConfig | None = None,
) -> tuple[int, dict[int, str]]:
    """Fetch every stage's checkpoint at the first of ``steps`` all stages have into ``dest``.

    ``dest`` gets the checkpoint layout ``assemble`` reads. ``local`` serves what this peer
    holds itself. Returns the step and, per stage, where its checkpoint came from;
    PeerUnavailable naming the stage and step when no candidate step could be gathered.
    """
    failures = []
    for step in steps:
        blobs: dict[int, bytes] = {}
        sources: dict[int, str] = {}
        try:
            for stage in range(allocation.d_pp):
                blob = local(stage, step) if local is not None else None
                sources[stage] = "this peer"
                if blob is None:
                    peers = [
                        *allocation.stages[stage],
                        *replica_peers(job_id, allocation, stage, CHECKPOINT_REPLICAS),
                    ]
                    peers = [p for p in dict.fromkeys(peers) if p != me]
                    blob = await fetch_state(
                        transport,
                        [peer_ref(p) for p in peers],
                        job_id,
                        stage,
                        step,
                        max_bytes=max_bytes,
                        config=config or StateSyncConfig(),
                    )
                    sources[stage] = "peers " + ", ".join(peers)
                check_checkpoint(blob, job_id, stage, step)
                blobs[stage] = blob
        except PeerdError as exc:
            failures.append(f"step {step}: {exc.message}")
            continue
        for stage, blob in blobs.items():
            directory = checkpoint.tasklet_dir(dest, job_id, stage, 0)
            directory.mkdir(parents=True, exist_ok=True)
            # crash-safe like the tasklets' own saves: a killed fetch never leaves a torn step file
            replace_file(checkpoint.checkpoint_file(directory, step), _writer(blob), suffix=".pt")
        return step, sources
    raise PeerUnavailable(
        f"no checkpoint of job {job_id} could be gathered: {'; '.join(failures) or 'no step'}"
    )


def load_model(path: str | Path) -> tuple[LayerStack, dict[str, Any]]:
    """A ``model.pt`` written by ``assemble``: the model with its weights, and the file's header
    (``peerd.models.open_checkpoint``; ``peerd.models.load_checkpoint`` returns the model alone)."""
    ck = open_checkpoint(path)
    return ck.model, {**ck.meta, "model": ck.family.describe()}
