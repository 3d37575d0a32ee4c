#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py; --help lists the pieces): with $PYTHON if set, else
# the repository's venv when there is one, else the system python3, the checkout on
# PYTHONPATH (the lent GPU machine has jax, flax, optax and orbax installed, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_check.py "$@"
