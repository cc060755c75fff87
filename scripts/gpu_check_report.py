"""The GPU check's report: the parts' outputs in OUT_DIR (scripts/gpu_check.sh) -> one JSON object.

Usage: python scripts/gpu_check_report.py OUT_DIR TESTS_RC BENCH_RC PIPELINE_RC
Reads cuda-tests.xml (pytest's JUnit XML), bench-compress.json (peerd bench compress) and
pipeline.json (scripts/gpu_pipeline_check.py); prints the summary and exits 0 when every part
passed: the CUDA tests ran (none skipped, none failed), the bench produced its figures, and the
pipeline matched the reference. The codec's roofline target (>= 25 % of the measured memory
bandwidth) is reported as ``bench.meets_target``, not a failure.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOFLINE_TARGET = 0.25


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"{path.name}: {exc}"}


def cuda_tests(out: Path, rc: int) -> dict[str, Any]:
    tests: dict[str, Any] = {"rc": rc, "log": str(out / "cuda-tests.log")}
    try:
        cases = list(ET.parse(out / "cuda-tests.xml").getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        tests.update(error=str(exc), ok=False)
        return tests

    def name(c: ET.Element) -> str:
        return f"{c.get('classname', '')}::{c.get('name', '')}"

    tests["tests"] = len(cases)
    tests["failed"] = [name(c) for c in cases if c.find("failure") is not None or c.find("error") is not None]
    tests["skipped"] = [name(c) for c in cases if c.find("skipped") is not None]
    tests["ok"] = rc == 0 and bool(cases) and not tests["failed"] and not tests["skipped"]
    return tests


def bench(out: Path, rc: int) -> dict[str, Any]:
    data = _load(out / "bench-compress.json")
    summary: dict[str, Any] = {
        "rc": rc,
        "target_roofline_fraction": ROOFLINE_TARGET,
        "full": str(out / "bench-compress.json"),
    }
    if "bits" not in data:
        summary.update(error=data.get("error", "no figures"), ok=False)
        return summary
    summary["device"] = data["config"].get("device_name", data["config"].get("device"))
    summary["memory_bandwidth_gbps"] = data["roofline"]["memory_bandwidth_gbps"]
    summary["per_bits"] = {
        b: {
            "delta_gbps": r["delta"]["gbps"],
            "delta_touched_gbps": r["delta"]["touched_gbps"],
            "delta_roofline_fraction": r["delta"]["roofline_fraction"],
            "delta_ratio_vs_baseline": r["delta"]["ratio_vs_baseline"],
            "quantize_pack_gbps": r["direct"]["quantize_pack_gbps"],
            "quantize_pack_roofline_fraction": r["direct"]["quantize_pack_roofline_fraction"],
            "unpack_dequantize_roofline_fraction": r["direct"]["unpack_dequantize_roofline_fraction"],
        }
        for b, r in sorted(data["bits"].items())
    }
    summary["meets_target"] = all(
        v["delta_roofline_fraction"] >= ROOFLINE_TARGET for v in summary["per_bits"].values()
    )
    summary["ok"] = rc == 0
    return summary


def pipeline(out: Path, rc: int) -> dict[str, Any]:
    data = _load(out / "pipeline.json")
    data["rc"] = rc
    data["ok"] = rc == 0 and bool(data.get("ok"))
    return data


def report(out: Path, tests_rc: int, bench_rc: int, pipe_rc: int) -> dict[str, Any]:
    parts = {
        "cuda_tests": cuda_tests(out, tests_rc),
        "bench": bench(out, bench_rc),
        "pipeline": pipeline(out, pipe_rc),
    }
    try:
        import torch

        env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    except Exception as exc:  # the report must still come out
        env = {"gpu": None, "error": str(exc)}
    return {"ok": all(p["ok"] for p in parts.values()), **env, **parts, "out_dir": str(out)}


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    result = report(Path(argv[0]), *map(int, argv[1:]))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
