"""``layout`` and ``pack``: right-padded rows, targets masked at the completion, behaviour log-probs aligned."""

from __future__ import annotations

import pytest
import torch

from peerd.models.launches import count_ops
from peerd.rl.rollout import RolloutGroup, layout, pack
from peerd.rl.tasks import PAD_TOKEN, Problem


def _group(prompt: str, completions: list[list[int]]) -> RolloutGroup:
    logprobs = [[-0.1 * (j + 1) - 0.01 * i for j in range(len(c))] for i, c in enumerate(completions)]
    return RolloutGroup(Problem(prompt, "x"), completions, logprobs, version=0)


def test_rows_are_right_padded_and_the_mask_marks_completion_targets():
    tokens, mask = layout([[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 10]])
    assert tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 10]] and tokens.dtype == torch.long
    # target t predicts token t + 1: the completion of row 0 starts at target 2, of row 1 at target 0
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    tokens, mask = layout([[5, 6]], [[1]], "cpu")
    assert tokens.tolist() == [[5, 6, 1]] and mask.tolist() == [[0, 1]]
    tokens, _ = layout([[5], [5, 6, 7]], [[1], [2]])
    assert tokens[0].tolist() == [5, 1, PAD_TOKEN, PAD_TOKEN]


def test_pack_aligns_each_rows_behaviour_logprobs_with_its_targets():
    groups = [_group("1+2=", [[51, 10], [52]]), _group("10+20=", [[51, 48, 10], []])]
    batch = pack(groups)
    assert batch.rows == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for row, (gi, ci) in enumerate(batch.rows):
        prompt, lps = groups[gi].problem.prompt_ids, groups[gi].logprobs[ci]
        start = len(prompt) - 1
        got = batch.old_logp_BT[row]
        assert got[start : start + len(lps)].tolist() == pytest.approx(lps)
        assert got.count_nonzero() == len(lps)  # zero at prompt and pad targets
        assert batch.mask_BT[row].sum() == len(lps)
    assert batch.old_logp_BT.dtype == torch.float32 and batch.mask_BT.dtype == torch.float32


def test_an_empty_batch_and_a_row_without_prompt():
    empty = pack([])
    assert (
        empty.tokens_BT.shape == (0, 1)
        and empty.mask_BT.shape == (0, 0)
        and empty.old_logp_BT.shape == (0, 0)
    )
    with pytest.raises(ValueError, match="prompt token"):
        layout([[]], [[1, 2]])


def test_packing_dispatches_a_fixed_number_of_ops_whatever_the_rows():
    # the RL cost model counts an inference task's ops once per iteration, not per row
    few = [_group("1+2=", [[51, 10]] * 2)]
    many = few * 16
    assert count_ops(lambda: pack(few)) == count_ops(lambda: pack(many))
