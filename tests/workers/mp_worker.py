"""One process of a multi-process test run (started by tests/_multiprocess.py).

``mp_worker.py train OUT``: trains the awkward model at every stage on process-local rows,
checks that the silent-wrong inputs raise, saves a checkpoint; writes results to OUT.<i>.
``mp_worker.py restore CKPT OUT``: restores CKPT (written by another process count).
``mp_worker.py lose kill|stop``: process 1 kills or freezes itself at step 3 of a loop.
"""

import json
import os
import signal
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["JZERO_LOCAL_CPU_DEVICES"]))

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _models import awkward_batches, awkward_loss, awkward_params  # noqa: E402
from _multiprocess import TRAIN_RUNS  # noqa: E402

import jzero  # noqa: E402

MODE = sys.argv[1]
jzero.distributed.initialize(timeout=10 if MODE == "lose" else 60)
rank, world = jax.process_index(), jax.process_count()
mesh = jzero.data_mesh()


def local_rows(batch):
    rows = batch["x"].shape[0] // world
    return jax.tree.map(lambda x: np.asarray(x)[rank * rows : (rank + 1) * rows], batch)


def expect_error(fn, text):
    try:
        fn()
    except ValueError as e:
        assert text in str(e), str(e)
        return str(e)
    raise AssertionError(f"no error: {text}")


if MODE == "train":
    out = {"losses": {}, "params": {}, "errors": []}
    for name, (stage, comm) in TRAIN_RUNS.items():
        comm = jzero.Communication(**comm)
        opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1, comm=comm)
        state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
        losses = []
        for batch in awkward_batches(3, batch_size=16):
            state, metrics = step(state, jzero.distributed.global_batch(mesh, local_rows(batch)))
            losses.append(float(metrics["loss"]))
        out["losses"][name] = losses
        full = opt.full_params(state)  # replicated: every process holds it whole
        out["params"][name] = {k: np.asarray(v).tolist() for k, v in full.items()}
        if name == "3":
            report = jzero.report(
                step, state, jzero.distributed.global_batch(mesh, local_rows(batch))
            )
            out["report_comm"] = report.comm_bytes["total"]
            ckpt = jzero.Checkpointer(sys.argv[3])
            ckpt.save(3, state)
            ckpt.close()
            jzero.checkpoint.export_safetensors(opt, state, sys.argv[3] + ".safetensors")
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=2)
    state = opt.init(awkward_params())
    numpy_batch = jax.tree.map(np.asarray, awkward_batches(1)[0])
    out["errors"].append(
        expect_error(lambda: opt.train_step(awkward_loss)(state, numpy_batch), "ambiguous")
    )
    mine = awkward_params(seed=rank)  # a different seed on each process
    out["errors"].append(expect_error(lambda: opt.init(mine), "differs between processes"))
    with open(f"{sys.argv[2]}.{rank}", "w") as f:
        json.dump(out, f)

elif MODE == "restore":
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=1, min_shard_size=1)
    restored = jzero.Checkpointer(sys.argv[2]).restore(opt, awkward_params())
    full = opt.full_params(restored.state)
    with open(f"{sys.argv[3]}.{rank}", "w") as f:
        json.dump({k: np.asarray(v).tolist() for k, v in full.items()}, f)

elif MODE == "lose":
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), mesh, stage=3)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
    batch = jzero.distributed.global_batch(mesh, local_rows(awkward_batches(1)[0]))
    with jzero.distributed.bounded(timeout=5) as watchdog:
        for i in range(10_000):
            if rank == 1 and i == 3:
                print("losing process 1", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if sys.argv[2] == "kill" else signal.SIGSTOP)
            state, metrics = step(state, batch)
            float(metrics["loss"])
            watchdog.beat()
