#!/usr/bin/env bash
# Runs a stated subset of the tests on the oldest supported versions (ci/oldest-pins.txt) in
# a fresh venv of its own: the core numerics against Optax, the HLO collectives of every
# stage, Flax Linen/NNX, per-layer gathering, mixed precision, checkpoints and the checks
# that name each JAX internal jzero relies on. scripts/test.sh runs everything on the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv-oldest =3.12  # the GPU image's Python minor
.venv-oldest/bin/python -m pip install -q -e '.[dev]' -c ci/oldest-pins.txt
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" \
    tests/test_versions.py tests/test_jax_internals.py tests/test_parity.py \
    tests/test_hlo_stages.py tests/test_flax.py tests/test_autogather.py \
    tests/test_precision.py tests/test_checkpoint.py "$@"
