#!/usr/bin/env bash
# Runs a stated subset of the tests on the oldest supported versions (ci/oldest-pins.txt:
# the lent GPU image's exact set, jax 0.11.2 on Python 3.12) in a fresh venv of its own:
# the core numerics against Optax, the HLO collectives of every stage, Flax Linen/NNX,
# per-layer gathering and prefetch, mixed precision, checkpoints, the host optimizer step
# (compute_on's form changed in jax 0.11.1) with its delayed update and partial offload,
# the compiled peak per memory space (it reads XLA's HLO text), the checks that name each
# JAX internal jzero relies on and the moved-internal fallbacks, autoconfigure's search (it
# compiles and reads every candidate), and the GPU check's CPU dry run (test_gpu_check).
# scripts/test.sh runs everything on the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv-oldest =3.12  # the GPU image's Python minor
.venv-oldest/bin/python -m pip install -q -e '.[dev]' -c ci/oldest-pins.txt
# The fast tests of the subset, and the whole of test_gpu_check (its dry run is `slow`).
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider -n "${JZERO_TEST_WORKERS:-2}" \
    tests/internal/test_versions.py tests/internal/test_jax_internals.py \
    tests/core/test_moved_internals.py tests/core/test_parity.py tests/core/test_precision.py \
    tests/core/test_config.py tests/core/gather/test_autogather.py \
    tests/core/gather/test_prefetch.py tests/core/offload/test_offload_host_step.py \
    tests/core/offload/test_offload_delay.py tests/core/offload/test_offload_ratio.py \
    tests/accounting/test_hlo_stages.py tests/accounting/test_memory_spaces.py \
    tests/adapters/test_flax.py tests/checkpoint/test_checkpoint.py \
    tests/autoconfig/test_autoconfigure.py "$@"
.venv-oldest/bin/python -m pytest -q -p no:cacheprovider -m '' tests/project/test_gpu_check.py "$@"
