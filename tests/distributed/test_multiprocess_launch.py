"""Multi-process launches: HSDP with the replica axis across real processes trains on the
right rows, and a mismatched launch is named before its first collective instead of hanging.

2 processes x 4 CPU devices on 127.0.0.1 (gloo), started by tests/_multiprocess.py running
tests/workers/mp_hsdp_worker.py; the single-device Optax oracle is computed here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params, reference
from _multiprocess import run_processes
from _paths import WORKERS
from jax.experimental import multihost_utils

import jzero
from jzero.core.agreement import check_processes_agree

WORKER = WORKERS / "mp_hsdp_worker.py"
RTOL, ATOL = 1e-5, 1e-6  # fp32: sums over 2 x 4 devices, in another order than on one


def _ok(results):
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow  # real processes: in CI (-m ''), not in the quick default run
def test_hsdp_across_processes_matches_single_device_optax(tmp_path):
    out = tmp_path / "out"
    _ok(run_processes(WORKER, 2, "hsdp", str(out), local_devices=4, timeout=300))
    runs = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(2)]
    assert runs[0] == runs[1]  # every process ends with the same numbers and errors
    run = runs[0]
    # 8 local rows per process -> 16 global rows, split over both batch axes
    assert run["batch"] == {"shape": [16, 40], "spec": "P(('replica', 'data'),)"}
    ref = reference(optax.adam(1e-2), awkward_params(), awkward_loss, awkward_batches(3))
    for stage in "0123":
        np.testing.assert_allclose(run["losses"][stage], ref.losses, rtol=RTOL, atol=ATOL)
        for name, want in ref.params.items():
            got = np.asarray(run["params"][stage][name], np.float32)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{stage} {name}")
    # the configuration is compared once per step object and batch layout, not per step
    assert run["gathers"] == {"0": 1, "1": 1, "2": 1, "3": 1, "new shape, then an agreed one": 1}
    # an 8-row batch over 'data' only (the old global_batch) is refused on every process
    assert run["wrong_sharding"].startswith(
        "batch leaf ['x'] (shape (8, 40)) is placed as P('data',), but the step splits its "
        "rows over the axes ('replica', 'data') of the mesh {'replica': 2, 'data': 4}"
    )
    assert "jzero.distributed.global_batch(mesh, local_rows)" in run["wrong_sharding"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "what, field, held",
    [
        ("stage", "'stage' differs: process 0: 3; process 1: 2", "the same stage="),
        (
            "rows",
            "'batch' differs: process 0: ['x']: float32[8, 40] as P('data',), this process's "
            "part [4, 40]",
            "as many rows on each process",
        ),
    ],
)
def test_a_mismatched_launch_is_named_on_every_process_instead_of_hanging(what, field, held):
    # safety net only: unchecked, the first step hangs until gloo's 30 s read timeout
    results = run_processes(WORKER, 2, "mismatch", what, local_devices=4, timeout=240)
    for i, r in enumerate(results):
        assert f"process {i}: first step" in r.stdout
        assert r.returncode == 1, f"process {i}: {r.returncode}\n{r.stderr[-3000:]}"
        error = r.stderr.strip().splitlines()
        start = error.index(
            "ValueError: the 2 processes of this run are not running the same training step "
            "(compared before its first collective, which would hang until a timeout):"
        )
        assert error[start + 1].startswith(f"- {field}"), error[start + 1]
        assert held in error[start + 1]
        assert "Gloo" not in "\n".join(error[start:]) and "trained" not in r.stdout


def _fields(stage="3", plan="5 parameter leaves", batch="['x']: float32[16, 40]"):
    return {
        "stage": stage,
        "mesh": "{'data': 8}",
        "precision": "Precision()",
        "step options": "grad_accum=1",
        "plan": plan,
        "batch": batch,
    }


def _agree_in_threads(monkeypatch, per_process):
    """Runs ``check_processes_agree`` as len(per_process) "processes" (threads) whose
    ``process_allgather`` stacks what each passed, refusing arrays of different shapes
    (as the real gather cannot take them). Returns each one's error (or None)."""
    n, slots, barrier, rank = len(per_process), {}, threading.Barrier(len(per_process)), {}

    def gather(x):
        slots[rank[threading.get_ident()]] = np.asarray(x)
        barrier.wait()
        shapes = {a.shape for a in slots.values()}
        assert len(shapes) == 1, shapes
        out = np.stack([slots[i] for i in range(n)])
        barrier.wait()
        return out

    monkeypatch.setattr(multihost_utils, "process_allgather", gather)
    errors = [None] * n

    def process(i):
        rank[threading.get_ident()] = i
        try:
            check_processes_agree(per_process[i])
        except ValueError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=process, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


def test_every_process_gets_the_same_error_naming_fields_and_processes(monkeypatch):
    long_plan = "6 parameter leaves (659 elements)\n" + "leaf table " * 100
    per_process = [_fields(), *[_fields(stage="2") for _ in range(4)], _fields(plan=long_plan)]
    errors = _agree_in_threads(monkeypatch, per_process)
    assert errors[1:] == errors[:-1]  # the same message on every process
    sha = hashlib.sha256(long_plan.encode()).hexdigest()[:12]
    assert errors[0].splitlines() == [
        "the 6 processes of this run are not running the same training step (compared before "
        "its first collective, which would hang until a timeout):",
        "- 'stage' differs: processes 0, 5: 3; processes 1-4: 2. Fix: start every process "
        "with the same stage=.",
        "- 'plan' differs: processes 0-4: 5 parameter leaves; process 5: 6 parameter leaves "
        f"(659 elements) ... (sha256 {sha}). Fix: give every process the same parameter "
        "shapes and dtypes, Optax transformation, param_specs, min_shard_size and offload "
        "settings.",
    ]
    # the same configuration everywhere: one gather, no error
    assert _agree_in_threads(monkeypatch, [_fields() for _ in range(3)]) == [None] * 3


def test_one_process_compares_nothing(monkeypatch):
    def no_gather(x):
        raise AssertionError("a single process gathers nothing")

    monkeypatch.setattr(multihost_utils, "process_allgather", no_gather)
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=3)
    state, metrics = opt.train_step(awkward_loss)(opt.init(awkward_params()), awkward_batches(1)[0])
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
