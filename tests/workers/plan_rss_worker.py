"""The subprocess half of tests/project/test_plan_gpu.py's host-memory bound: one
compile of Llama 3 70B's stage-3 step (``examples/llama.py``) for 64 H200s over 8 hosts,
with ``jzero.report``, in a fresh interpreter, so that its peak resident memory
(``ru_maxrss``) is the plan's own.

``python tests/workers/plan_rss_worker.py`` prints one JSON line: ``params``,
``peak_rss_bytes`` (``VmHWM``: this process's own peak; ``ru_maxrss`` would include the
resident memory of the parent it was forked from, e.g. a pytest worker's),
``device_bytes`` (the compiled per-device peak) and ``collective_bytes`` (sent per device
per step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")  # compile-only GPUs need JAX on the CPU

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "scripts")]
import jax.numpy as jnp  # noqa: E402
import llama  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from plan_gpu import peak_rss_bytes  # noqa: E402  (scripts/plan_gpu.py: VmHWM)

import jzero  # noqa: E402


def main() -> None:
    problem = llama.problem(size="70b", batch=64)
    mesh = jzero.gpu_mesh("h200", devices=64, hosts=8)
    config = jzero.ZeroConfig(stage=3, precision=problem["config"].precision)
    opt = jzero.ZeroOptimizer(problem["tx"], mesh, config=config)
    state = jax.eval_shape(*opt.init_program(init_fn=problem["init_fn"]))
    tokens = problem["batch"]["tokens"]
    rows = NamedSharding(mesh, P("data"))
    batch = {"tokens": jax.ShapeDtypeStruct(tokens.shape, jnp.int32, sharding=rows)}
    report = jzero.report(opt.train_step(problem["loss_fn"]), state, batch)
    print(json.dumps({
        "params": llama.count_params(state.params),
        "peak_rss_bytes": peak_rss_bytes(),
        "device_bytes": report.peak_bytes,
        "collective_bytes": report.comm_bytes["total"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
