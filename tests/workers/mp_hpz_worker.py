"""One process of the multi-process hpZ test
(tests/core/comm/test_hpz.py::test_hpz_across_processes).

``mp_hpz_worker.py OUT``: a data mesh over every process's devices, stage 3 with
``Communication(hpz=4)`` (groups of 4 = one process's devices); trains the scanned model on
process-local rows placed with ``global_batch``, and writes the losses, the full
parameters, the compiled step's bytes per part of the data axis and the device groups of
its across-group all-gathers to OUT.<i>.
"""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["JZERO_LOCAL_CPU_DEVICES"]))

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from _models import make_tx, stacked_batch, stacked_loss, stacked_params  # noqa: E402

import jzero  # noqa: E402

jzero.distributed.initialize(timeout=60)
rank, world = jax.process_index(), jax.process_count()


def main(out_path):
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(
        make_tx(eps=1e-3), mesh, stage=3, min_shard_size=1, comm=jzero.Communication(hpz=4)
    )
    state, step = opt.init(stacked_params()), opt.train_step(stacked_loss)
    batch = stacked_batch()
    rows = batch["x"].shape[0] // world
    local = jax.tree.map(lambda x: np.asarray(x)[rank * rows : (rank + 1) * rows], batch)
    placed = jzero.distributed.global_batch(mesh, local)
    rep = jzero.report(step, state, placed)
    losses = []
    for _ in range(3):
        state, metrics = step(state, placed)
        losses.append(float(metrics["loss"]))
    params = opt.full_params(state)["layers"]
    across = [
        list(g) for c in rep.collectives if c.kind == "all-gather" and c.group_size == 2
        for g in c.groups
    ]  # fmt: skip
    out = {
        "losses": losses,
        "params": {k: np.asarray(v).tolist() for k, v in params.items()},
        "by_axis": rep.comm_bytes_by_axis,
        "across_groups": across,
    }
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(out, f)


main(sys.argv[1])
