"""A state consumed by a donating train step is refused by every entry point that reads
it, with the error that says to use the returned state -- never a crash.

jaxlib 0.10.2 segfaults when a compiled program reads a deleted buffer: once the
``full_params`` program was compiled, ``opt.full_params`` of a consumed state killed the
process. The calls run in a subprocess (tests/workers/consumed_state_worker.py), each after the
program it runs was compiled on a live state, so a segfault fails these tests instead of
killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _paths import TESTS, WORKERS

ENTRIES = [
    "ZeroOptimizer.full_params",
    "ZeroOptimizer.full_state",
    "TrainStep.__call__",
    "TrainStep.lower",
    "jzero.report",
    "linen.TrainState.params",
    "linen.TrainState.variables",
    "linen step",
    "linen step.lower",
    "jzero.report (linen)",
    "nnx.TrainState.model",
    "nnx step",
    "nnx step.lower",
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(WORKERS / "consumed_state_worker.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"worker exited with {run.returncode}:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_worker_calls_every_entry_point(outcomes):
    assert sorted(outcomes) == sorted(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_consumed_state_is_refused(outcomes, entry):
    kind, message = outcomes[entry]
    assert kind == "ValueError", (kind, message)
    assert "was deleted: this state was donated to (consumed by) an earlier train_step" in message
    assert "Use the returned state" in message and "donate=False" in message
