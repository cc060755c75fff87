"""``peerd bench pipeline`` on real peer processes: links matched to a regime, and the speed-up there."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from peerd.bench.pipeline import command

pytestmark = pytest.mark.integration


def test_matched_links_put_the_uncompressed_run_in_the_asked_regime_where_acsgd_pays() -> None:
    args = "--part training --layouts 1 --links 1000 --match 4 --warmup 1 --steps 2 --train-repeats 1"
    args += " --d-model 32 --replica-batch 32 --micro-batch 16 --codecs none,acsgd-fw4-bw8"
    result = CliRunner().invoke(command, args.split(), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    setup = json.loads(result.output)["training"]["by_setup"]["2x1-gpipe"]
    unshaped_s = setup["regime"]["unshaped_step_s"]
    matched = setup["regime"]["matched-x4"]
    # the bandwidth follows from the layout's own unshaped step: 4x its time per direction in fp32
    assert matched["link_over_compute"] == pytest.approx(4.0, abs=0.01)
    assert matched["fp32_link_s_per_direction"] == pytest.approx(4 * unshaped_s, rel=0.01)
    assert setup["regime"]["1000mbit"]["link_over_compute"] < 1
    row = setup["by_link"]["matched-x4"]
    # GPipe sends both directions in series: uncompressed pays ~8 unshaped steps of link time there,
    # 4-bit forward and 8-bit backward ~1.5
    assert row["none"]["step_s_median"] > 4 * unshaped_s
    assert row["acsgd-fw4-bw8"]["speedup_vs_none"] > 1.5
    summary = json.loads(result.output)["training"]["speedup_at_matched_regimes"]
    assert summary == {
        "2x1-gpipe": {"matched-x4": {"acsgd-fw4-bw8": row["acsgd-fw4-bw8"]["speedup_vs_none"]}}
    }


def test_a_bad_match_ratio_is_refused_by_name() -> None:
    result = CliRunner().invoke(command, ["--match", "0"])
    assert result.exit_code != 0 and "--match" in result.output
