"""A pipeline job's per-layer work beside its FLOPs, counted on narrow copies (``peerd.pipeline.launches``)."""

from __future__ import annotations

import dataclasses

import pytest

from peerd.models.gpt import GPTConfig
from peerd.models.registry import GPTFamily
from peerd.pipeline.launches import MAX_LOGITS, _count, count_layer_work, narrowed


@pytest.mark.parametrize("d_ff", [None, 96])
def test_the_narrow_counts_give_the_real_widths_work_exactly(d_ff: int | None) -> None:
    family = GPTFamily(GPTConfig(n_layer=3, n_head=4, d_model=48, d_ff=d_ff, vocab_size=200, max_seq_len=32))
    work = count_layer_work(family, micro_batch=3, seq=24)
    assert work is not None and len(work) == family.num_layers
    for index, counted in enumerate(work):
        ops, traffic, elements, *_ = _count(family, index, 3, 24)
        assert counted.ops == ops
        if d_ff is None or index in (0, family.num_layers - 1):
            assert counted.traffic_bytes == traffic
        else:  # an MLP width that is no multiple of the narrow widths: as close as rounding lets it
            assert counted.traffic_bytes == pytest.approx(traffic, rel=0.02)
        assert dataclasses.astuple(counted.elements) == tuple(float(v) for v in elements.values())
    assert work[1] is work[2] is work[3]  # identical blocks are counted once
    assert work[0].elements.gelu == 0 and work[1].elements.gelu > 0  # the embedding has no MLP
    assert work[-1].elements.softmax == 3 * 24 * 200  # the loss's log-softmax over the vocabulary


def test_the_update_is_counted_with_the_jobs_optimizer_and_grows_with_the_parameters() -> None:
    from peerd.pipeline.optim import OptimizerConfig

    family = GPTFamily(GPTConfig(n_layer=2, n_head=4, d_model=48, vocab_size=200, max_seq_len=32))
    adamw = count_layer_work(family, 2, 16, OptimizerConfig(name="adamw", lr=1e-3))
    sgd = count_layer_work(family, 2, 16, OptimizerConfig(name="sgd", lr=1e-3))
    assert adamw is not None and sgd is not None
    block = _count(family, 1, 2, 16, OptimizerConfig(name="adamw", lr=1e-3))
    assert (adamw[1].update_ops, adamw[1].update_traffic_bytes) == (block.update_ops, block.update_traffic)
    # two moments read and written besides the weights and gradients: more bytes than plain SGD
    assert adamw[1].update_traffic_bytes > sgd[1].update_traffic_bytes > 0
    params = sum(p.numel() for p in family.build_layer(1).parameters())
    assert adamw[1].update_traffic_bytes >= 4 * params * 6  # weights, grads, moments and their copies
    assert count_layer_work(family, 2, 16)[1].update_ops == 0  # type: ignore[index]


def test_models_too_large_to_count_are_priced_by_their_flops() -> None:
    family = GPTFamily(GPTConfig(n_layer=1, n_head=2, d_model=8, vocab_size=1 << 12, max_seq_len=1 << 12))
    assert count_layer_work(family, micro_batch=MAX_LOGITS // (1 << 24) + 1, seq=1 << 12) is None
    narrow = narrowed(family, 3)
    assert isinstance(narrow, GPTFamily) and narrow.hidden == 6
