"""One member's averaging arithmetic, counted on the runtime's code and fitted in group size and values."""

from __future__ import annotations

import pytest

from peerd.averaging.work import _count, count_member_work


@pytest.mark.parametrize("compressor", [None, "q8", "q4"])
def test_the_fit_matches_a_count_at_another_group_size_and_length(compressor):
    work = count_member_work(compressor)
    bits = None if compressor is None else int(compressor[1:])
    for members, values in ((3, 3 * 5000), (8, 8 * 3000 + 5)):  # shares that end in a part-group
        ops, moved = _count(members, values, bits, None)
        fitted_ops, per_value = work.at(members)
        assert fitted_ops == pytest.approx(ops, rel=0.02)  # odd-length 4-bit tails pack with a few more
        assert moved == pytest.approx(values * per_value, rel=0.01)


def test_quantizing_costs_more_than_raw_and_a_clipped_mean_more_than_the_mean():
    raw, q8 = count_member_work(None).at(4), count_member_work("q8").at(4)
    assert q8[0] > raw[0] and q8[1] > raw[1]
    clipped = count_member_work("q8", "clipped").at(4)
    assert clipped[0] > q8[0] and clipped[1] >= q8[1]
