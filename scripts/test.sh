#!/usr/bin/env bash
# The test command: install (dev extras), lint, check import layers, type-check, run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k records -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
. .venv/bin/activate
echo "== ruff"
ruff check peerd tests scripts protocols
echo "== import layers"
lint-imports
echo "== mypy"
mypy
echo "== pytest"
python -m pytest "$@"
