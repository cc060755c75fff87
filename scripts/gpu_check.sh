#!/usr/bin/env bash
# The GPU check (issue 11), for a CUDA machine after scripts/install.sh. Prints one JSON object:
#   cuda_tests : every test that needs a CUDA device (skipped elsewhere; none may be skipped here)
#   bench      : peerd bench compress --device cuda (GB/s, and the fraction of the GPU's
#                memory-bandwidth roofline measured in the same run, per code width)
#   pipeline   : 2 stages x 1 replica as two peer processes sharing the GPU (scripts/gpu_pipeline_check.py):
#                exactness vs the single-process reference, stage step times GPU vs CPU, bf16
# Exit status: 0 all parts passed, 1 a part failed, 2 no CUDA device (nothing run).
# Usage: scripts/gpu_check.sh [OUT_DIR]   (the parts' raw outputs stay in OUT_DIR; default: a temp dir)
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -f .venv/bin/activate ]] && . .venv/bin/activate
PY=${PYTHON:-python}
out=${1:-$(mktemp -d -t peerd-gpu-check.XXXXXX)}
mkdir -p "$out"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>"$out/torch.err"; then
  reason="no CUDA device: torch.cuda.is_available() is false (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo missing))"
  printf '{"ok": false, "error": "%s"}\n' "$reason"
  echo "gpu_check: $reason; run it on a machine with an NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
if ! "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then  # the dev extras carry pytest
  "$PY" -m pip install -q -e ".[dev]" >"$out/pip.log" 2>&1 || echo "gpu_check: could not install the dev extras (see $out/pip.log)" >&2
fi

# 1. every CUDA-marked test: the files that say "needs a CUDA device", their tests named *cuda*
mapfile -t files < <(grep -rl "needs a CUDA device" tests --include='*.py' | sort)
"$PY" -m pytest -q -p no:cacheprovider -k cuda -rs --junitxml="$out/cuda-tests.xml" "${files[@]}" \
  >"$out/cuda-tests.log" 2>&1
tests_rc=$?

# 2. the codec on the GPU against the GPU's memory-bandwidth roofline
timeout 900 peerd bench compress --device cuda --out "$out/bench-compress.json" >"$out/bench-compress.log" 2>&1
bench_rc=$?

# 3. a 2-stage x 1-replica pipeline sharing the GPU
timeout 1500 "$PY" scripts/gpu_pipeline_check.py --device cuda --out "$out/pipeline.json" >"$out/pipeline.log" 2>&1
pipe_rc=$?

"$PY" scripts/gpu_check_report.py "$out" "$tests_rc" "$bench_rc" "$pipe_rc"
