"""Multi-process runs: real processes on 127.0.0.1 (JAX's gloo CPU collectives).

2 processes x 4 CPU devices train exactly like 1 process x 8 devices (fp32 rounding), on
process-local batches, also with ZeRO++'s int8 gathers and gradient all-to-alls; the
silent-wrong inputs raise; checkpoints cross process counts; a lost peer ends every
survivor with a message within the bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params
from _multiprocess import TRAIN_RUNS, run_processes
from _paths import WORKERS

import jzero

WORKER = WORKERS / "mp_worker.py"


def single_process(stage, comm=None):
    opt = jzero.ZeroOptimizer(
        optax.adam(1e-2), jzero.data_mesh(), stage=stage, min_shard_size=1, comm=comm
    )
    state, step, losses = opt.init(awkward_params()), opt.train_step(awkward_loss), []
    for batch in awkward_batches(3, batch_size=16):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, state, losses


def _ok(results):
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow  # real processes: in CI (-m ''), not in the quick default run
@pytest.mark.smoke
def test_two_processes_train_like_one_and_checkpoints_cross_process_counts(tmp_path):
    out, ckpt = tmp_path / "out", str(tmp_path / "ckpt")
    _ok(run_processes(WORKER, 2, "train", str(out), ckpt, local_devices=4, timeout=300))
    runs = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(2)]
    assert runs[0] == runs[1]  # every process ends with the same numbers
    run = runs[0]
    assert set(run["losses"]) == set(TRAIN_RUNS)
    for key, (stage, comm) in TRAIN_RUNS.items():
        opt, state, losses = single_process(stage, jzero.Communication(**comm))
        np.testing.assert_allclose(run["losses"][key], losses, rtol=1e-6)
        for name, want in opt.full_params(state).items():
            np.testing.assert_allclose(
                run["params"][key][name], want, rtol=1e-6, atol=1e-7, err_msg=name
            )
    _, state3, _ = single_process(3)
    # the silent-wrong cases of a multi-process run now raise, naming the fix
    numpy_error, params_error = run["errors"]
    assert "jzero.distributed.global_batch(mesh, local_rows)" in numpy_error
    assert "params leaf ['b1'] differs between processes (process 1 vs process 0)" in params_error
    assert run["report_comm"] > 0

    # written by 2 processes (stage 3 on 2x4 devices) -> restored here by 1 (stage 1, 8)
    here = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=1, min_shard_size=1)
    restored = jzero.Checkpointer(ckpt).restore(here, awkward_params())
    got = here.full_params(restored.state)
    for name, want in run["params"]["3"].items():
        np.testing.assert_array_equal(got[name], np.asarray(want, np.float32), err_msg=name)
    exported = jzero.checkpoint.load_safetensors(ckpt + ".safetensors")
    for name, want in run["params"]["3"].items():
        np.testing.assert_array_equal(exported[name], np.asarray(want, np.float32))

    # written here by 1 process -> restored by 2
    opt3 = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3, min_shard_size=1)
    mine = str(tmp_path / "mine")
    with jzero.Checkpointer(mine) as c:
        c.save(3, state3)
    back = tmp_path / "back"
    _ok(run_processes(WORKER, 2, "restore", mine, str(back), local_devices=4, timeout=180))
    want = opt3.full_params(state3)
    for i in range(2):
        got = json.loads(Path(f"{back}.{i}").read_text())
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name], np.float32), want[name])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_peer_ends_the_survivor_with_a_message_within_the_bound(how):
    results = run_processes(WORKER, 2, "lose", how, local_devices=2, timeout=120, grace=2)
    survivor, lost = results
    assert "losing process 1" in lost.stdout
    assert survivor.returncode == 1, survivor.stderr[-3000:]
    assert "jzero: process 0 of 2:" in survivor.stderr
    assert (
        "no training step finished in 5 s" in survivor.stderr or "a step failed" in survivor.stderr
    ), survivor.stderr[-3000:]
    # jzero left first: status 1 with its message, not JAX's heartbeat abort (SIGABRT, 134)
    # nor the run_processes safety timeout -- no wall-clock bound, which a loaded CPU breaks
    assert "Terminating process" not in survivor.stderr, survivor.stderr[-3000:]


def test_numpy_batch_is_fine_in_one_process():
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=3)
    batch = jax.tree.map(np.asarray, awkward_batches(1)[0])
    state, _ = opt.train_step(awkward_loss)(opt.init(awkward_params()), batch)
    assert int(state.step) == 1
    placed = jzero.distributed.global_batch(opt.mesh, batch)
    assert placed["x"].sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_array_equal(placed["x"], batch["x"])


def test_global_batch_needs_rows_that_split_over_local_devices():
    mesh = jzero.data_mesh()
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(12, 3\).*multiple of 8"):
        jzero.distributed.global_batch(mesh, {"x": np.ones((12, 3))})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"timeout": 0}, "timeout must be a number of seconds >= 1"),
        ({"num_processes": 2, "process_id": 2}, r"process_id 2 is outside 0..1"),
    ],
)
def test_initialize_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jzero.distributed.initialize("127.0.0.1:1", **kwargs)


def test_watchdog_exits_with_a_message_when_steps_stop():
    code = (
        "import time, jzero\n"
        "w = jzero.distributed.watchdog.Watchdog(0.5).start()\n"
        "w.beat(); time.sleep(0.2); w.beat()\n"
        "time.sleep(5)\n"
        "print('not reached')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not reached" not in out.stdout
    assert out.stderr.strip().endswith(
        "jzero: process 0 of 1: no training step finished in 0.5 s (after step 2): a peer "
        "process is dead or frozen, or one step became slower than the timeout (raise it). "
        "Exiting; restart from the last checkpoint."
    )


def test_bounded_in_one_process_lets_errors_through():
    with pytest.raises(RuntimeError, match="boom"), jzero.distributed.bounded(timeout=60) as w:
        w.beat()
        raise RuntimeError("boom")
