"""scripts/gpu_check.sh's CPU-safe parts: the clear refusal without CUDA, the report it prints, and its
pipeline check run on the CPU (what it runs on the GPU, with the device swapped)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from peerd.bench.compress import command as bench_compress

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@NO_CUDA
def test_gpu_check_says_there_is_no_cuda_and_runs_nothing(tmp_path: Path):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    result = json.loads(done.stdout)
    assert result["ok"] is False and "no CUDA device" in result["error"]
    assert "NVIDIA GPU" in done.stderr
    assert not (tmp_path / "cuda-tests.xml").exists()  # nothing ran


@NO_CUDA
def test_pipeline_check_refuses_a_missing_cuda_device(capsys):
    assert _script("gpu_pipeline_check").main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in json.loads(capsys.readouterr().out)["error"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.unit.compress.test_quant" name="test_cuda_encode_matches_cpu_decode" time="0.1"/>
<testcase classname="tests.unit.pipeline.test_device" name="test_boundary[cuda]" time="0.2">{extra}</testcase>
</testsuite></testsuites>"""


def _outputs(out: Path, *, extra: str = "", pipeline_ok: bool = True) -> None:
    threads = torch.get_num_threads()
    args = ["--rows", "64", "--cols", "128", "--examples", "4", "--microbatches", "2", "--epochs", "2"]
    args += ["--bits", "2,4", "--repeat", "2", "--threads", "1", "--out", str(out / "bench-compress.json")]
    ran = CliRunner().invoke(bench_compress, args)  # the real bench (on the CPU)
    torch.set_num_threads(threads)
    assert ran.exit_code == 0, ran.output
    (out / "cuda-tests.xml").write_text(JUNIT.format(extra=extra))
    (out / "pipeline.json").write_text(json.dumps({"ok": pipeline_ok, "device_vs_reference_max_rel": 0.0}))


def test_report_combines_the_three_parts(tmp_path: Path):
    report = _script("gpu_check_report").report
    _outputs(tmp_path)
    result = report(tmp_path, 0, 0, 0)
    assert result["ok"] is True
    assert result["cuda_tests"]["tests"] == 2 and result["cuda_tests"]["skipped"] == []
    bench = result["bench"]
    assert set(bench["per_bits"]) == {"2", "4"} and bench["memory_bandwidth_gbps"] > 0
    assert bench["per_bits"]["4"]["delta_roofline_fraction"] > 0
    assert isinstance(bench["meets_target"], bool) and bench["target_roofline_fraction"] == 0.25
    assert result["pipeline"]["ok"] is True


def test_report_fails_on_a_skipped_cuda_test_a_failed_pipeline_or_missing_output(tmp_path: Path):
    report = _script("gpu_check_report").report
    _outputs(tmp_path, extra='<skipped message="needs a CUDA device"/>')
    result = report(tmp_path, 0, 0, 0)
    assert result["ok"] is False and result["cuda_tests"]["skipped"] == [
        "tests.unit.pipeline.test_device::test_boundary[cuda]"
    ]
    _outputs(tmp_path, pipeline_ok=False)
    assert report(tmp_path, 0, 0, 1)["pipeline"]["ok"] is False
    (tmp_path / "bench-compress.json").unlink()
    bench = report(tmp_path, 0, 1, 0)["bench"]
    assert bench["ok"] is False and "bench-compress.json" in bench["error"]
    main = _script("gpu_check_report").main
    assert main([str(tmp_path), "0", "1", "0"]) == 1 and main([]) == 2


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_pipeline_check_runs_two_stage_processes_on_the_cpu(tmp_path: Path):
    out = tmp_path / "pipeline.json"
    args = ["--device", "cpu", "--steps", "3", "--layers", "2", "--d-model", "64", "--seq-len", "32"]
    args += ["--batch", "4", "--micro-batch", "2", "--threads", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_pipeline_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["errors"] == {}
    assert result["device_vs_reference_max_rel"] < 1e-4  # two processes, real streams: the reference curve
    assert result["bf16_trains"] and result["bf16_losses"] != result["device_losses"]
    assert (
        set(result["stage_step_s_device"])
        == set(result["stage_speedup_device_vs_cpu"])
        == {"stage0", "stage1"}
    )
    assert set(result["stage_compute_s_device"]) == {"stage0", "stage1"}  # each stage's own compute
    assert all(v > 0 for v in result["stage_compute_speedup_device_vs_cpu"].values())
