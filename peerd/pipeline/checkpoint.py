"""Atomic per-stage checkpoints: module, optimizer, next step, data position, codec and averaging state.

One directory per (job, stage, replica) holds ``step-NNNNNNNN.pt`` files, ``N`` being the next
step to run. A save writes a temporary file in the same directory, fsyncs it, renames it over
the final name and fsyncs the directory, so a crash leaves either the old or the new file,
never a torn one; then all but the newest ``keep`` files are deleted, except those younger
than ``retain_s`` seconds (a churn-tolerant job keeps them: when a whole stage dies, the
others must roll back to the step of its newest checkpoint copy, which lags behind). Resuming a pipeline
needs one step that every stage replica has saved: ``common_step``. The optional ``codecs``
entry holds the stage's AC-SGD buffers (``BoundaryCodecs.state_dict``) in the same file, so
they are saved and restored atomically with the weights they belong to.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from peerd.durable import TMP_PREFIX, replace_file
from peerd.errors import ConfigError
from peerd.log import get_logger

logger = get_logger(__name__)

FORMAT = 1
_NAME = re.compile(r"step-(\d{8})\.pt")
REQUIRED = ("format", "job", "stage", "replica", "step", "module", "optimizer", "data", "meta")


def tasklet_dir(root: str | Path, job: str, stage: int, replica: int) -> Path:
    return Path(root) / job / f"stage{stage}-replica{replica}"


def checkpoint_file(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def saved_steps(directory: str | Path) -> list[int]:
    """Steps with a complete checkpoint in ``directory``, ascending (temporary files are ignored)."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.iterdir() if (m := _NAME.fullmatch(p.name)))


def common_step(root: str | Path, job: str, tasklets: Iterable[tuple[int, int]]) -> int | None:
    """The newest step every ``(stage, replica)`` has a checkpoint of; None when there is none."""
    common: set[int] | None = None
    for stage, replica in tasklets:
        steps = set(saved_steps(tasklet_dir(root, job, stage, replica)))
        common = steps if common is None else common & steps
    return max(common) if common else None


def save(directory: str | Path, state: dict[str, Any], keep: int = 2, retain_s: float = 0.0) -> Path:
    """Write ``state`` (which must hold ``REQUIRED`` keys) atomically as its step's file; prune old files.

    Files beyond the newest ``keep`` are deleted once they are older than ``retain_s`` seconds.
    """
    missing = [k for k in REQUIRED if k not in state]
    assert not missing, f"checkpoint state lacks {missing}"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{TMP_PREFIX}*"):  # a crash mid-save left it: one saver per directory
        with contextlib.suppress(OSError):
            stale.unlink()
    final = replace_file(
        checkpoint_file(directory, int(state["step"])), lambda fh: torch.save(state, fh), suffix=".pt"
    )
    now = time.time()
    for old in saved_steps(directory)[:-keep]:
        path = checkpoint_file(directory, old)
        with contextlib.suppress(OSError):
            if retain_s <= 0 or now - path.stat().st_mtime >= retain_s:
                path.unlink()
    logger.debug("checkpoint %s written", final)
    return final


def load(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The checkpoint of ``step`` (default: the newest) in ``directory``; ConfigError if absent or unreadable."""
    directory = Path(directory)
    steps = saved_steps(directory)
    if step is None:
        if not steps:
            raise ConfigError("checkpoint_dir", f"no checkpoint in {directory}")
        step = steps[-1]
    path = checkpoint_file(directory, step)
    if not path.is_file():
        raise ConfigError("checkpoint_dir", f"no checkpoint of step {step} in {directory} (have {steps})")
    try:
        # weights_only: a checkpoint may come from another peer; it must not run code when loaded
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt or foreign file
        raise ConfigError("checkpoint_dir", f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise ConfigError("checkpoint_dir", f"{path} is not a peerd stage checkpoint")
    if state["format"] != FORMAT:
        raise ConfigError("checkpoint_dir", f"{path} has format {state['format']}, this peerd reads {FORMAT}")
    return state
