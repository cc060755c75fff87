#!/usr/bin/env bash
# Install peerd into ./.venv (created if missing). Usage: scripts/install.sh [--dev]
#
# torch is a dependency without a pinned version. If the venv has no torch yet we
# choose a build before pip resolves peerd, so that a CPU-only machine does not
# download a multi-GB CUDA build: a local CPU wheel if the machine carries one, else
# the CPU wheel index, else whatever pip picks (GPU machines). PEERD_TORCH_SPEC
# (e.g. "torch==2.5.1") overrides the choice.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if [[ -n "${PEERD_TORCH_SPEC:-}" ]]; then
    "$VPY" -m pip install -q "$PEERD_TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    # CPU-only machine: never the default CUDA build. First a CPU wheel that pip's configured
    # find-links/indexes already carry (some machines ship torch 2.13.0+cpu on local disk; the
    # "+cpu" local version exists on no public index, so elsewhere this fails at once), then the
    # official CPU index (failing fast where it is unreachable), then whatever pip resolves.
    "$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || "$VPY" -m pip install -q --retries 1 --timeout 15 torch --index-url https://download.pytorch.org/whl/cpu \
      || "$VPY" -m pip install -q torch
  fi
fi
"$VPY" -m pip install -q -e ".${extras}"
echo "peerd installed in .venv ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
