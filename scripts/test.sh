#!/usr/bin/env bash
# Runs the whole test suite (fast tests and the `slow` end-to-end ones) in a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" -m '' "$@"
