#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py; --help lists the pieces): with the repository's
# venv when there is one, else the system python3 with the checkout on PYTHONPATH (the
# lent GPU machine has jax, flax, optax and orbax installed and no network).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_check.py "$@"
