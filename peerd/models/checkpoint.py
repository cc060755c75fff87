"""The model file ``peerd fetch`` writes, and the one call that loads it: ``peerd.models.load_checkpoint(path)``.

A model file is a torch file holding ``{"format": 2, "model": {"family", "config", "seed"},
"state_dict": {"layers.<i>.*": tensor}, ...}`` plus whatever the writer adds (``job``, ``step``).
The description is enough to rebuild the model without the job spec, for every family of
``peerd.models.registry`` (format 1, GPT only, still loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peerd.durable import remove_leftovers, replace_file
from peerd.errors import ConfigError
from peerd.models.registry import ModelFamily, WithWeights, family_from
from peerd.models.stack import LayerStack
from peerd.models.weights import MODEL_FORMAT, open_weights


@dataclass
class Checkpoint:
    model: LayerStack
    family: ModelFamily
    """The family the model was built from (its shape: ``max_seq_len``, ``vocab_size``, ...)."""
    meta: dict[str, Any]
    """The file's header: ``format``, and ``job``/``step`` for a fetched job."""


def save_checkpoint(
    path: str | Path, family: ModelFamily, state_dict: dict[str, torch.Tensor], **meta: Any
) -> Path:
    """Write a model file for ``family`` with ``state_dict`` (``LayerStack`` keys); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "format": MODEL_FORMAT, "model": family.describe(), "state_dict": state_dict}
    remove_leftovers(p)  # of an earlier writer killed mid-save
    # a reader never sees half a file, and a kill at any moment leaves the previous one whole
    return replace_file(p, lambda fh: torch.save(payload, fh), suffix=".pt")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The model in a peerd model file (or the directory holding ``model.pt``), with its family and header."""
    source = open_weights(path, field="checkpoint")
    if source.description is None:
        raise ConfigError("checkpoint", f"{path}: not a peerd model file (written by 'peerd fetch')")
    family = WithWeights(family_from(source.description), source, field="checkpoint")
    model = family.build()
    model.eval()
    return Checkpoint(model, family, dict(source.meta or {}))


def load_checkpoint(path: str | Path) -> LayerStack:
    """Load a ``peerd fetch`` output: the model (tokens (B, T) -> logits (B, T, V)) in eval mode."""
    return open_checkpoint(path).model
