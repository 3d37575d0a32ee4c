"""The tests' own set-up (tests/conftest.py) changes how fast XLA compiles, not what it
compiles: its code-generation flags leave XLA's HLO passes as they are, so the programs
the tests read (collectives, schedules, buffer assignments) are the defaults' programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import conftest
import jax
import numpy as np
import pytest
from _paths import TESTS, WORKERS

sys.path.insert(0, str(WORKERS))
import codegen_worker  # noqa: E402

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("JZERO_TEST_DEFAULT_CODEGEN")), reason="the defaults are in use"
)


def test_the_tests_compile_with_the_fast_code_generation_flags():
    assert set(conftest.FAST_CODEGEN) <= set(os.environ["XLA_FLAGS"].split())


def test_the_flags_compile_the_programs_xla_compiles_by_default():
    """A jzero stage-2 step over a scanned stack, compiled here (flags on) and in a process
    with XLA's defaults: the same optimised HLO and buffer sizes, on the CPU and for
    8 H200s (with JAX's CUDA plugin, which scripts/test.sh installs). Its machine code is
    not the same, so after two AdamW steps on the CPU the parameters and loss are held to
    the suite's fp32 tolerance, not bit for bit. (Measured: this program's are bitwise the
    defaults'; the same stack without remat, bias and gather ended with 928 of 16,641
    values different, by at most 8.2e-8.)"""
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f not in conftest.FAST_CODEGEN]
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"XLA_FLAGS": " ".join(flags), "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, str(WORKERS / "codegen_worker.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    defaults = json.loads(run.stdout.strip().splitlines()[-1])
    trained = codegen_worker.trained(jax.make_mesh((8,), ("data",)))
    for got, want in zip(trained, defaults.pop("trained"), strict=True):
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)
    assert codegen_worker.figures() == defaults
