"""The data section of a job spec and the one function that turns it into a dataset."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from peerd.data.dataset import WindowDataset
from peerd.data.sources import DEFAULT_MAX_BYTES, Corpus, builtin_corpus, hf_corpus, text_files_corpus
from peerd.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it is cut into examples."""

    source: Literal["builtin", "text", "hf"] = "builtin"
    """``builtin``: this Python's stdlib text (no download); ``text``: local files; ``hf``: HF datasets."""
    seq_len: int = 128
    """Tokens per training example (each window holds ``seq_len + 1`` bytes)."""
    stride: int | None = None
    """Offset between consecutive windows; ``None`` means ``seq_len`` (no overlap)."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Cap on corpus size in bytes."""
    paths: list[str] = field(default_factory=list)
    """For ``text``: files or glob patterns, read in this order."""
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

    def validate(self) -> None:
        if self.seq_len < 1:
            raise ConfigError("seq_len", f"must be >= 1, got {self.seq_len}")
        if self.max_bytes < 1:
            raise ConfigError("max_bytes", f"must be >= 1, got {self.max_bytes}")
        if self.source == "text" and not self.paths:
            raise ConfigError("paths", "source 'text' needs at least one path")
        if self.source == "hf" and not self.hf_name:
            raise ConfigError("hf_name", "source 'hf' needs hf_name")
        if self.source != "text" and self.paths:
            raise ConfigError("paths", f"only used with source 'text', not {self.source!r}")


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


def build_dataset(cfg: DataConfig) -> WindowDataset:
    """The windowed dataset the job trains on."""
    return WindowDataset(load_corpus(cfg), cfg.seq_len, cfg.stride)
