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


def test_bench_reports_the_roofline_and_refuses_a_missing_device(tmp_path):
    threads = torch.get_num_threads()
    args = ["--rows", "64", "--cols", "128", "--examples", "4", "--microbatches", "2", "--epochs", "2"]
    result = CliRunner().invoke(command, [*args, "--bits", "4", "--repeat", "2", "--threads", "1"])
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["config"]["device"] == "cpu"
    bandwidth = data["roofline"]["memory_bandwidth_gbps"]
    assert bandwidth > 0
    delta, direct = data["bits"]["4"]["delta"], data["bits"]["4"]["direct"]
    # touched bytes: 6 x 4 + 2 x 4/8 = 25 per element for the 4-bit round trip
    assert abs(delta["touched_gbps"] - delta["gbps"] * 25 / 4) < 1e-3 * max(1.0, delta["gbps"])
    fraction = delta["touched_gbps"] / bandwidth  # the bandwidth is printed rounded to 0.01 GB/s
    assert abs(delta["roofline_fraction"] - fraction) <= 0.02 * fraction + 1e-4
    assert direct["quantize_pack_roofline_fraction"] > 0  # a toy size sits in cache: may exceed 1
    assert delta["buffer_device_bytes_per_side"] == 0  # a CPU run keeps its buffers in RAM
    if not torch.cuda.is_available():
        refused = CliRunner().invoke(command, [*args, "--device", "cuda"])
        assert refused.exit_code == 2 and "CUDA is not available" in refused.output
    refused = CliRunner().invoke(command, [*args, "--device", "tpu"])
    assert refused.exit_code == 2 and "--device" in refused.output
