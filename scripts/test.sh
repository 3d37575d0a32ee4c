#!/usr/bin/env bash
# Runs the whole test suite (fast tests and the `slow` end-to-end ones) in a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv  # a Python >= 3.12 (scripts/python.sh finds one)
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" -m '' "$@"
