"""One process of a multi-process HSDP / launch-agreement test
(tests/distributed/test_multiprocess_launch.py).

``mp_hsdp_worker.py hsdp OUT``: ``jzero.hybrid_mesh(2)`` with the replica axis across the
processes; trains the awkward model at stages 0-3 on process-local rows placed with
``global_batch``, counts the agreement's gathers, and checks that a batch sharded over
'data' only is refused; writes results to OUT.<i>.
``mp_hsdp_worker.py mismatch stage|rows``: process 0 and process 1 start one step with a
different stage, or with a different number of local rows; the step must raise.
"""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["JZERO_LOCAL_CPU_DEVICES"]))

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _models import awkward_batches, awkward_loss, awkward_params  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jzero  # noqa: E402

MODE = sys.argv[1]
jzero.distributed.initialize(timeout=60)
rank, world = jax.process_index(), jax.process_count()


def local_rows(batch, rows=None):
    rows = rows or batch["x"].shape[0] // world
    return jax.tree.map(lambda x: np.asarray(x)[rank * rows : (rank + 1) * rows], batch)


gathers = 0
allgather = multihost_utils.process_allgather


def counted_allgather(*args, **kwargs):
    global gathers
    gathers += 1
    return allgather(*args, **kwargs)


multihost_utils.process_allgather = counted_allgather


def hsdp(out_path):
    mesh = jzero.hybrid_mesh(2)  # (replica 2, data 4): replica 0 on process 0, replica 1 on 1
    out = {"losses": {}, "params": {}, "gathers": {}}
    batches = awkward_batches(3, batch_size=16)
    for stage in range(4):
        opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1)
        state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
        before, losses = gathers, []
        for batch in batches:
            placed = jzero.distributed.global_batch(mesh, local_rows(batch))
            state, metrics = step(state, placed)
            losses.append(float(metrics["loss"]))
        out["gathers"][stage] = gathers - before
        out["losses"][stage] = losses
        out["params"][stage] = {
            k: np.asarray(v).tolist() for k, v in opt.full_params(state).items()
        }
    out["batch"] = {"shape": list(placed["x"].shape), "spec": str(placed["x"].sharding.spec)}
    # A new batch shape (32 rows) is agreed on once; back to 16 rows: already agreed.
    before = gathers
    for batch in [*awkward_batches(2, batch_size=32), batches[0]]:
        state, _ = step(state, jzero.distributed.global_batch(mesh, local_rows(batch)))
    out["gathers"]["new shape, then an agreed one"] = gathers - before
    # The old way: each process's rows over 'data' only (an 8-row batch that differs
    # between the replicas) is refused, not trained on.
    wrong = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), x),
        local_rows(batches[0]),
    )
    try:
        step(state, wrong)
        out["wrong_sharding"] = "no error"
    except ValueError as e:
        out["wrong_sharding"] = str(e)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(out, f)


def mismatch(what):
    mesh = jzero.data_mesh()
    stage = 3 if (what == "stage" and rank == 0) else 2
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), mesh, stage=stage, min_shard_size=1)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
    rows = 4 * (1 + rank) if what == "rows" else None  # 4 local rows on process 0, 8 on 1
    batch = jzero.distributed.global_batch(mesh, local_rows(awkward_batches(1)[0], rows))
    print(f"process {rank}: first step", flush=True)
    state, metrics = step(state, batch)  # raises
    print(f"process {rank}: trained, loss {float(metrics['loss'])}", flush=True)


if MODE == "hsdp":
    hsdp(sys.argv[2])
elif MODE == "mismatch":
    mismatch(sys.argv[2])
