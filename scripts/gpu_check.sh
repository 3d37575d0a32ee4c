#!/usr/bin/env bash
# The GPU check (the package scripts/gpu_check/; --help lists the pieces): with $PYTHON if
# set, else the repository's venv when there is one, else the system python3, the
# checkout and scripts/ on PYTHONPATH (the lent GPU machine has jax, flax, optax and orbax
# installed, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PYTHONPATH=".:scripts${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m gpu_check "$@"
