"""Single-process reference executor: staged == unstaged training, GPipe == 1F1B, hooks see the boundaries."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from peerd.data.dataset import WindowDataset
from peerd.data.sources import builtin_corpus
from peerd.models.gpt import GPT, GPTConfig
from peerd.pipeline.local import (
    LocalPipeline,
    LocalRunConfig,
    MeanReducer,
    micro_batches_of,
    train_pipelined,
    train_unstaged,
)
from peerd.pipeline.optim import OptimizerConfig
from peerd.pipeline.partition import partition

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, max_seq_len=32)


@pytest.fixture(scope="module")
def dataset() -> WindowDataset:
    return WindowDataset(builtin_corpus(64 * 1024), seq_len=32)


def _rel(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _run(dataset: WindowDataset, **kw: object) -> tuple[list[float], GPT]:
    model = GPT(CFG, seed=0)
    cfg = LocalRunConfig(**{"steps": 20, "global_batch": 8, "micro_batch_size": 2, "lr": 3e-3, **kw})  # type: ignore[arg-type]
    return train_pipelined(model, dataset, cfg), model


def test_staged_training_matches_unstaged_over_20_steps(dataset: WindowDataset) -> None:
    ref_model = GPT(CFG, seed=0)
    ref = train_unstaged(
        ref_model, dataset, LocalRunConfig(steps=20, global_batch=8, micro_batch_size=8, lr=3e-3)
    )
    assert ref[-1] < ref[0] - 0.5  # it actually trains
    staged, model = _run(dataset, layers_per_stage=[2, 1, 3], schedule="1f1b")
    assert _rel(staged, ref) < 1e-4
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


def test_clipping_across_stages_follows_torchs_clip_grad_norm(dataset: WindowDataset) -> None:
    """The reference clips with the workers' float64 cross-stage norm: torch's clip_grad_norm_ on the
    unstaged model gives the same curve up to float rounding, and the clip is active (not a no-op)."""
    opt = OptimizerConfig(lr=3e-3, grad_clip=0.3)
    unstaged = train_unstaged(
        GPT(CFG, seed=0), dataset, LocalRunConfig(steps=20, global_batch=8, micro_batch_size=8, optimizer=opt)
    )
    staged, _ = _run(dataset, layers_per_stage=[2, 1, 3], optimizer=opt, lr=None)
    assert _rel(staged, unstaged) < 1e-4
    unclipped, _ = _run(dataset, layers_per_stage=[2, 1, 3])
    assert max(abs(a - b) for a, b in zip(staged, unclipped, strict=True)) > 1e-2


def test_gpipe_equals_1f1b(dataset: WindowDataset) -> None:
    gp, _ = _run(dataset, layers_per_stage=[3, 3], schedule="gpipe")
    one, _ = _run(dataset, layers_per_stage=[3, 3], schedule="1f1b")
    assert _rel(gp, one) < 1e-6


def test_two_replicas_with_mean_reduce_match_full_batch(dataset: WindowDataset) -> None:
    ref = train_unstaged(
        GPT(CFG, seed=0),
        dataset,
        LocalRunConfig(steps=20, global_batch=8, micro_batch_size=8, lr=3e-3, replicas=2),
    )
    dp, _ = _run(dataset, layers_per_stage=[3, 3], replicas=2)
    assert _rel(dp, ref) < 1e-4


class RecordingHook:
    """Records every boundary crossing; optionally rounds activations to ``bits`` of mantissa."""

    def __init__(self, lossy: bool = False) -> None:
        self.acts: list[tuple[int, list[int], tuple[int, ...]]] = []
        self.grads: list[tuple[int, list[int], tuple[int, ...]]] = []
        self.lossy = lossy

    def activations(self, boundary: int, example_ids: Sequence[int], acts_BTC: torch.Tensor) -> torch.Tensor:
        self.acts.append((boundary, list(example_ids), tuple(acts_BTC.shape)))
        return acts_BTC.half().float() if self.lossy else acts_BTC

    def gradients(self, boundary: int, example_ids: Sequence[int], grads_BTC: torch.Tensor) -> torch.Tensor:
        self.grads.append((boundary, list(example_ids), tuple(grads_BTC.shape)))
        return (grads_BTC * 0.5) if self.lossy else grads_BTC


def test_hook_sees_every_boundary_with_example_ids(dataset: WindowDataset) -> None:
    model = GPT(CFG, seed=0)
    hook = RecordingHook()
    pipe = LocalPipeline(partition(model, [2, 2, 2]), "1f1b", hook)
    ids = [5, 9, 1, 7]
    stats = pipe.forward_backward(micro_batches_of(dataset, ids, 2))
    assert sorted((b, tuple(i)) for b, i, _ in hook.acts) == [
        (0, (1, 7)),
        (0, (5, 9)),
        (1, (1, 7)),
        (1, (5, 9)),
    ]
    assert sorted((b, tuple(i)) for b, i, _ in hook.grads) == sorted((b, tuple(i)) for b, i, _ in hook.acts)
    assert {shape for _, _, shape in hook.acts} == {(2, 32, CFG.d_model)}
    assert stats.peak_live == [2, 2, 1]
    assert all(p.grad is not None for p in model.parameters())


def test_a_lossy_hook_changes_the_gradients(dataset: WindowDataset) -> None:
    grads = []
    for lossy in (False, True):
        model = GPT(CFG, seed=0)
        LocalPipeline(partition(model, [3, 3]), "gpipe", RecordingHook(lossy)).forward_backward(
            micro_batches_of(dataset, [0, 1, 2, 3], 2)
        )
        grads.append(model.layers[0].tok.weight.grad.clone())
    ratio = grads[1].norm() / grads[0].norm()
    assert 0.4 < ratio < 0.6  # the halved boundary gradient reaches stage 0


class ZeroingReducer(MeanReducer):
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def reduce(self, stage: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        self.calls.append((stage, len(grads)))
        return [g * 0 for g in super().reduce(stage, grads)]


def test_reducer_is_applied_per_stage_and_controls_the_update(dataset: WindowDataset) -> None:
    model = GPT(CFG, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    reducer = ZeroingReducer()
    cfg = LocalRunConfig(steps=1, global_batch=4, micro_batch_size=2, layers_per_stage=[3, 3], replicas=2)
    train_pipelined(model, dataset, cfg, reducer=reducer)
    assert reducer.calls == [(0, 2), (1, 2)]
    # Zero gradients through AdamW with no weight decay leave every weight unchanged.
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
