"""The data section of a job spec and the one function that turns it into a dataset."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

from peerd.data.dataset import WindowDataset
from peerd.data.sources import DEFAULT_MAX_BYTES, Corpus, builtin_corpus, hf_corpus, text_files_corpus
from peerd.data.validation import ValidationConfig, validation_micro_batches
from peerd.errors import ConfigError
from peerd.loading import Range, check, problems


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it is cut into examples."""

    source: Literal["builtin", "text", "hf"] = "builtin"
    """``builtin``: this Python's stdlib text (no download); ``text``: local files; ``hf``: HF datasets."""
    seq_len: Annotated[int, Range(ge=1)] = 128
    """Tokens per training example (each window holds ``seq_len + 1`` bytes)."""
    stride: Annotated[int | None, Range(ge=1, le=2**31 - 1)] = None
    """Offset between consecutive windows; ``None`` means ``seq_len`` (no overlap)."""
    max_bytes: Annotated[int, Range(ge=1, le=2**62)] = DEFAULT_MAX_BYTES  # read() takes a C ssize_t
    """Cap on corpus size in bytes."""
    paths: list[str] = field(default_factory=list)
    """For ``text``: files, directories (every file below, sorted) or glob patterns, read in this
    order. Every peer reads them at these paths; ``peerd submit`` makes them absolute and pins
    ``expect_digest`` to the submitter's copy (``pin_local_source``)."""
    hf_name: str | None = None
    """For ``hf``: dataset id or builder (``text``, ``json``...)."""
    hf_config: str | None = None
    """For ``hf``: dataset configuration name."""
    hf_split: str = "train"
    """For ``hf``: the split to read."""
    hf_data_files: list[str] | None = None
    """For ``hf``: local data files passed to ``load_dataset``."""
    text_field: str = "text"
    """For ``hf``: the column holding the text."""
    expect_digest: str | None = None
    """If set, the corpus's SHA-256 must equal it (peers must see the same bytes)."""
    validation: ValidationConfig | None = None
    """A held-out split at the end of the corpus and how often its loss is evaluated; null: none."""

    def problems(self) -> list[ConfigError]:
        needs = {"text": ("paths", "at least one path"), "hf": ("hf_name", "hf_name")}
        out = [
            ConfigError(name, f"source {self.source!r} needs {what}")
            for source, (name, what) in needs.items()
            if self.source == source and not getattr(self, name)
        ]
        if self.source != "text" and self.paths:
            out.append(ConfigError("paths", f"only used with source 'text', not {self.source!r}"))
        return out

    def validate(self) -> None:
        """Every problem, raised (for a config built in code rather than loaded)."""
        check(problems(self), "the data config")


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured source and check its digest if the config pins one."""
    cfg.validate()
    if cfg.source == "builtin":
        corpus = builtin_corpus(cfg.max_bytes)
    elif cfg.source == "text":
        corpus = text_files_corpus(cfg.paths, cfg.max_bytes)
    else:
        assert cfg.hf_name is not None  # validate() checked
        corpus = hf_corpus(
            cfg.hf_name,
            split=cfg.hf_split,
            text_field=cfg.text_field,
            config_name=cfg.hf_config,
            data_files=cfg.hf_data_files,
            max_bytes=cfg.max_bytes,
        )
    if cfg.expect_digest is not None and corpus.digest != cfg.expect_digest:
        raise ConfigError(
            "data.expect_digest",
            f"corpus {corpus.name} has digest {corpus.digest}, expected {cfg.expect_digest}",
        )
    return corpus


def pin_local_source(cfg: DataConfig) -> DataConfig:
    """What ``peerd submit`` publishes for a ``text`` source: absolute paths and the digest of the bytes here.

    There is no file transfer: every peer with a tasklet reads the files at the same absolute
    path (as with ``init_checkpoint``), and with the submitter's digest pinned one whose copy
    differs fails naming ``data.expect_digest`` instead of training on other bytes. Relative
    paths are relative to the submitter's working directory (as ``model.hf`` paths). Reading
    the corpus here also reports a missing, empty or unreadable path before anything is
    published (ConfigError naming ``data.paths[i]``). Other sources are returned unchanged.
    """
    if cfg.source != "text":
        return cfg
    pinned = dataclasses.replace(cfg, paths=[os.path.abspath(p) for p in cfg.paths])
    return dataclasses.replace(pinned, expect_digest=load_corpus(pinned).digest)


def check_split(cfg: DataConfig, global_batch: int) -> None:
    """At submit: the validation split fits the corpus as read here, else a ConfigError naming the field.

    Each tasklet checks again on its own copy (a ``fraction`` of another Python's built-in
    corpus is another number of windows); this only spares an owner publishing a job that
    every tasklet would refuse. ``hf`` sources are not read at submit.
    """
    if cfg.validation is None or cfg.source == "hf":
        return
    held_out = build_dataset(cfg).held_out_ids()  # ConfigError if no training window is left
    validation_micro_batches(
        held_out, cfg.validation, global_batch=global_batch, micro_batch=global_batch, replica=0, replicas=1
    )


def build_dataset(cfg: DataConfig) -> WindowDataset:
    """The windowed dataset the job trains on, with its held-out windows when ``validation`` is set."""
    corpus = load_corpus(cfg)
    held_out = 0
    if cfg.validation is not None:
        held_out = cfg.validation.held_out(len(WindowDataset(corpus, cfg.seq_len, cfg.stride)))
    return WindowDataset(corpus, cfg.seq_len, cfg.stride, held_out)
