"""Plans for GPU clusters that are not here: ``jzero.autoconfigure(target=...)`` on a
Llama-style NNX model, and the same model in the user's own ``jit`` step, compiled by XLA's
GPU compiler on this machine's CPU.

    JAX_PLATFORMS=cpu python scripts/plan_gpu.py --out benchmarks/gpu_plans.json
    JAX_PLATFORMS=cpu python scripts/plan_gpu.py --quick --out /tmp/plans.json   # ~2 min

The plans (:data:`PLANS`; ``examples/llama.py``: Llama 3's shapes, 4096-token sequences,
AdamW, bf16 parameters over fp32 master weights and moments, each layer rematerialised):

- ``llama8b_h100x8``: 8 B on 8 H100s (one host), every stage: the chosen stage and
  micro-batch, the compiled per-device peak against the budget, and the same configuration
  at the next-larger micro-batch, which does not fit;
- ``llama70b_h200x64``: 70 B on 64 H200s over 8 hosts (the estimator leaves stage 3 only):
  the chosen configuration's per-device peak and collective bytes per step;
- ``llama70b_h200x64_user``: that model in the user's own ``jax.jit`` step with
  ``jzero.shard_optimizer(stage=3)`` (parameters placed by ``jzero.shard_params``, each
  layer gathered by ``jzero.gather(mesh=)``), at the chosen micro-batch: one micro-batch
  per step, as a user's step without accumulation trains.

Each plan runs in a fresh process, so its peak resident memory (``VmHWM``) is its own:
nothing the model's size is allocated here. ``--quick`` plans the tiny model on the
same targets with a small budget, so that micro-batches cut (a smoke run, ~6 minutes).
benchmarks/README.md documents the JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import llama  # noqa: E402  examples/llama.py
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jzero  # noqa: E402
from jzero.accounting import collectives, comm_bytes  # noqa: E402
from jzero.accounting.memory_spaces import of_compiled  # noqa: E402
from jzero.autoconfig.target import target_mesh  # noqa: E402
from jzero.cli.autoconfigure import to_json  # noqa: E402
from jzero.core.gpu_target.topology import cuda_plugin  # noqa: E402


class Plan(NamedTuple):
    name: str
    size: str  # a key of llama.SIZES
    target: str  # autoconfigure's target=
    batch: int  # the global batch, in sequences
    user: str | None = None  # the plan whose chosen micro-batch the user's step takes
    budget: float | None = None  # bytes per device (None: the target's)


PLANS = (
    Plan("llama8b_h100x8", "8b", "h100:8", 64),
    Plan("llama70b_h200x64", "70b", "h200:8x8", 512),
    Plan("llama70b_h200x64_user", "70b", "h200:8x8", 512, user="llama70b_h200x64"),
)
QUICK = (
    Plan("tiny_h100x8", "tiny", "h100:8", 64, budget=24e6),
    Plan("tiny_h200x64", "tiny", "h200:8x8", 512, budget=24e6),
    Plan("tiny_h200x64_user", "tiny", "h200:8x8", 512, user="tiny_h200x64", budget=24e6),
)


def _on_cpu() -> None:
    if jax.config.jax_platforms != "cpu":  # compile-only GPUs need JAX on the CPU
        jax.config.update("jax_platforms", "cpu")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``: its own, where ``ru_maxrss`` would
    include its parent's at the fork that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux


def autoconfigure(plan: Plan) -> dict[str, Any]:
    """The search for ``plan``'s target, as ``python -m jzero autoconfigure --json`` prints it."""
    _on_cpu()
    start = time.perf_counter()
    problem = llama.problem(size=plan.size, batch=plan.batch)
    choice = jzero.autoconfigure(
        problem["loss_fn"],
        init_fn=problem["init_fn"],
        batch=problem["batch"],
        tx=problem["tx"],
        config=problem["config"],
        target=plan.target,
        device_budget=plan.budget,
    )
    return {
        "search": to_json(choice),
        "wall_seconds": time.perf_counter() - start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def user_step(plan: Plan, micro_batch: int) -> dict[str, Any]:
    """The user's own jit step at stage 3 for ``plan``'s target, ``micro_batch`` rows per
    GPU: its per-device peak and collective bytes, as compiled."""
    _on_cpu()
    start = time.perf_counter()
    mesh, _ = target_mesh(plan.target)
    cfg = dataclasses.replace(llama.SIZES[plan.size], gather_mesh=mesh)
    graphdef, shapes = llama.abstract(cfg)
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), shapes)
    params = jzero.shard_params(bf16, mesh)  # abstract, sharded as stage 3 keeps them
    tx = jzero.shard_optimizer(
        optax.adamw(3e-4, weight_decay=0.1),
        mesh,
        stage=3,
        precision=jzero.Precision(param_dtype="bf16"),
    )
    loss_fn = llama.make_loss_fn(cfg, graphdef)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(tx.init, params)
    rows = micro_batch * mesh.size
    tokens = jax.ShapeDtypeStruct(
        (rows, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )
    out = (*jax.tree.map(lambda x: x.sharding, (params, opt_state)), NamedSharding(mesh, P()))
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=out)
    compiled = jitted.trace(params, opt_state, {"tokens": tokens}).lower().compile()
    text = compiled.as_text()
    return {
        "micro_batch": micro_batch,
        "device_bytes": of_compiled(compiled, hlo_text=text)["device"],
        "collective_bytes": comm_bytes(collectives(text))["total"],
        "wall_seconds": time.perf_counter() - start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def _in_fresh_process(fn, *args) -> dict[str, Any]:
    """``fn(*args)`` in a spawned process of its own (its peak memory is its own)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def record(plan: Plan, done: dict[str, dict]) -> dict[str, Any]:
    """One plan's entry: its target, model and figures."""
    cfg = llama.SIZES[plan.size]
    _, shapes = llama.abstract(cfg)
    entry = {
        "name": plan.name,
        "size": plan.size,
        "target": plan.target,
        "global_batch": plan.batch,
        "seq_len": cfg.seq_len,
        "params": llama.count_params(shapes),
        "budget_override": plan.budget,
    }
    if plan.user is None:
        return entry | {"kind": "autoconfigure"} | _in_fresh_process(autoconfigure, plan)
    chosen = done[plan.user]["search"]
    micro = next(r for r in chosen["rows"] if r["name"] == chosen["chosen"])["micro_batch"]
    return entry | {"kind": "user_step"} | _in_fresh_process(user_step, plan, micro)


def run(plans: tuple[Plan, ...], quick: bool, log) -> dict[str, Any]:
    start, done = time.perf_counter(), {}
    for plan in plans:
        done[plan.name] = record(plan, done)
        log(f"{plan.name}: {done[plan.name]['wall_seconds']:.0f} s")
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "cuda_plugin": cuda_plugin(),
        "quick": quick,
        "model": "examples/llama.py (Flax NNX; bf16 parameters, fp32 master weights and "
        "AdamW moments; every layer rematerialised)",
        "plans": list(done.values()),
        "wall_seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--quick", action="store_true", help="the tiny model on the same targets, a 24 MB budget"
    )
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else PLANS, args.quick, lambda s: print(s, flush=True))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.out}: {result['wall_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
