"""`peerd bench compress` runs end to end at a toy size and reports the numbers the issue asks for."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from peerd.bench.compress import NaiveQuantizer, command


def test_bench_reports_ratios_errors_and_wire_size(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    args = ["--rows", "64", "--cols", "128", "--examples", "4", "--microbatches", "2", "--epochs", "3"]
    result = CliRunner().invoke(
        command, [*args, "--bits", "2,4", "--repeat", "2", "--threads", "1", "--out", str(out)]
    )
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data == json.loads(result.output)
    for bits in ("2", "4"):
        delta, direct = data["bits"][bits]["delta"], data["bits"][bits]["direct"]
        assert delta["gbps"] > 0 and delta["ratio_vs_baseline"] > 0
        assert len(delta["rel_error_per_epoch"]) == 2
        assert delta["rel_error"] < delta["baseline_rel_error"] * 1.2  # 64 rows: both near absmax
        assert direct["rel_error"] < direct["baseline_rel_error"] * 1.1 < 0.7
        assert int(bits) < direct["bits_per_element"] < int(bits) + 1


def test_baseline_quantizer_is_the_reference_algorithm():
    """The baseline must be a faithful reference-style quantizer, or the ratio means nothing."""
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    for bits, want in ((2, 0.50), (3, 0.25), (4, 0.125)):
        q = NaiveQuantizer(bits)
        y = q.decode(*q.encode(x), (1024, 256))
        err = float((y - x).norm() / x.norm())
        assert abs(err - want) < want * 0.15, (bits, err)
