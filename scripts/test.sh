#!/usr/bin/env bash
# Runs CI's tier of the test suite (fast tests and the `slow` end-to-end ones, less the
# `extended` cases, tests/_ci_tier.py; `-m ''` runs every test) in a fresh venv,
# .venv-test: jzero[dev] and the gpu-compile extra (JAX's CUDA plugin at jaxlib's version,
# for jzero.gpu_mesh's compiles for GPUs that are not there). Its own venv, because with
# that plugin installed a JAX program on a machine without a GPU prints the plugin's
# start-up error before it falls back to the CPU unless JAX_PLATFORMS=cpu is set (the
# tests set it; scripts/main.sh's .venv has no plugin and needs nothing). The files run
# in the order tests/conftest.py gives them: the longest recorded first
# (tests/durations.json), not xdist's most tests first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv-test  # a Python >= 3.12 (scripts/python.sh finds one)
.venv-test/bin/python -m pip install -q -e '.[dev]'
v=$(.venv-test/bin/python -c 'import jaxlib; print(jaxlib.__version__)')
.venv-test/bin/python -m pip install -q -e '.[dev,gpu-compile]' "jax-cuda12-plugin==$v" \
    "jax-cuda12-pjrt==$v"
.venv-test/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" \
    --dist loadgroup --no-loadscope-reorder -m 'not extended' "$@"
