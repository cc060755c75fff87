"""Datasets with a stable integer id per training example, deterministic shuffling and sharding."""

from peerd.data.config import DataConfig, build_dataset, load_corpus
from peerd.data.dataset import WindowDataset
from peerd.data.sampler import EpochSampler, micro_batches, shard
from peerd.data.sources import Corpus, builtin_corpus, hf_corpus, text_files_corpus
from peerd.data.validation import ValidationConfig, validation_micro_batches

__all__ = [
    "Corpus",
    "DataConfig",
    "EpochSampler",
    "ValidationConfig",
    "WindowDataset",
    "build_dataset",
    "builtin_corpus",
    "hf_corpus",
    "load_corpus",
    "micro_batches",
    "shard",
    "text_files_corpus",
    "validation_micro_batches",
]
