"""The validation split: held-out windows at the end, disjoint in bytes from training, the same on every build;
each replica's evaluation shard; bad settings refused naming their field."""

from __future__ import annotations

import pytest

from peerd.data.config import DataConfig, build_dataset
from peerd.data.dataset import WindowDataset
from peerd.data.sampler import EpochSampler
from peerd.data.sources import corpus_from_bytes
from peerd.data.validation import ValidationConfig, validation_micro_batches
from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.loading import collect

DATA = bytes(range(256)) * 8  # 2048 bytes


def _bytes_of(ds: WindowDataset, i: int) -> range:
    return range(i * ds.stride, i * ds.stride + ds.seq_len + 1)


@pytest.mark.parametrize(("seq_len", "stride"), [(10, None), (10, 7), (10, 3), (1, None)])
def test_held_out_windows_share_no_byte_with_any_training_window(seq_len: int, stride: int | None) -> None:
    whole = WindowDataset(corpus_from_bytes("t", DATA), seq_len, stride)
    ds = WindowDataset(corpus_from_bytes("t", DATA), seq_len, stride, held_out=20)
    held = ds.held_out_ids()
    assert len(held) == 20 and held.stop == len(whole)  # the last windows of the corpus
    last_train = max(_bytes_of(ds, len(ds) - 1))
    assert last_train < min(_bytes_of(ds, held.start))
    # as many training windows as fit before them: one more would overlap
    assert max(_bytes_of(ds, len(ds))) >= min(_bytes_of(ds, held.start))
    # the sampler draws training ids only
    sampler = EpochSampler(len(ds), global_batch=4, seed=1)
    drawn = {i for step in range(sampler.steps_per_epoch) for i in sampler.batch_ids(step)}
    assert drawn <= set(range(len(ds))) and not drawn & set(held)


def test_held_out_ids_are_readable_and_the_gap_is_not() -> None:
    ds = WindowDataset(corpus_from_bytes("t", DATA), 10, held_out=5)
    held = ds.held_out_ids()
    x, _ = ds.batch(list(held))
    assert x.shape == (5, 10)
    assert x[0, 0].item() == held.start * 10 % 256
    gap = len(ds)  # between the last training window and the first held-out one
    assert gap < held.start
    with pytest.raises(ProtocolError) as err:
        ds.batch([gap])
    assert err.value.code is ErrorCode.UNKNOWN_EXAMPLE


def test_the_split_is_part_of_the_digest() -> None:
    corpus = corpus_from_bytes("t", DATA)
    assert WindowDataset(corpus, 10).digest == f"{corpus.digest}:10:10"
    assert WindowDataset(corpus, 10, held_out=5).digest == f"{corpus.digest}:10:10:v5"


def _data(validation: ValidationConfig | None) -> DataConfig:
    return DataConfig(seq_len=32, max_bytes=64 * 1024, validation=validation)


def test_fraction_and_windows_from_the_config_the_same_on_every_build() -> None:
    total = len(build_dataset(_data(None)))
    by_fraction = build_dataset(_data(ValidationConfig(fraction=0.1)))
    assert len(by_fraction.held_out_ids()) == int(0.1 * total)
    by_windows = build_dataset(_data(ValidationConfig(windows=7)))
    assert list(by_windows.held_out_ids()) == list(range(total - 7, total))
    again = build_dataset(_data(ValidationConfig(windows=7)))
    assert again.held_out_ids() == by_windows.held_out_ids() and len(again) == len(by_windows)
    assert ValidationConfig(fraction=1e-9).held_out(100) == 1  # at least one window


def test_holding_out_everything_is_refused_naming_validation() -> None:
    with pytest.raises(ConfigError) as err:
        WindowDataset(corpus_from_bytes("t", DATA), 10, held_out=203)
    assert err.value.field == "data.validation"


def test_each_replica_evaluates_its_shard_of_each_held_out_batch() -> None:
    held = list(range(100, 140))
    cfg = ValidationConfig(windows=40, batches=2)
    shards = [
        validation_micro_batches(held, cfg, global_batch=8, micro_batch=2, replica=r, replicas=2)
        for r in (0, 1)
    ]
    assert shards[0] == [[100, 101], [102, 103], [108, 109], [110, 111]]
    assert shards[1] == [[104, 105], [106, 107], [112, 113], [114, 115]]
    one = validation_micro_batches(held, cfg, global_batch=8, micro_batch=4, replica=0, replicas=1)
    assert sorted(i for mb in one for i in mb) == held[:16]  # the same set, whatever the width
    too_many = ValidationConfig(windows=40, batches=6)
    with pytest.raises(ConfigError) as err:
        validation_micro_batches(held, too_many, global_batch=8, micro_batch=2, replica=0, replicas=1)
    assert err.value.field == "data.validation.batches"


def test_evaluation_steps() -> None:
    cfg = ValidationConfig(windows=4, interval=3)
    assert [k for k in range(0, 11) if cfg.evaluates_after(k, steps=10)] == [3, 6, 9, 10]


@pytest.mark.parametrize(
    ("mapping", "field"),
    [
        ({}, "windows"),
        ({"windows": 4, "fraction": 0.1}, "windows"),
        ({"fraction": 1.0}, "fraction"),
        ({"fraction": 0}, "fraction"),
        ({"windows": 0}, "windows"),
        ({"windows": 4, "interval": 0}, "interval"),
        ({"windows": 4, "batches": 0}, "batches"),
        ({"windows": 4, "every": 3}, "every"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(mapping: dict, field: str) -> None:
    _, errors = collect(DataConfig, {"validation": mapping})
    assert any(e.field == f"validation.{field}" for e in errors), [str(e) for e in errors]
