"""Time to the first step, per ZeRO stage, as the number of parameter leaves grows.

A model of unrolled layers (a Python loop over a list of layers, 5 leaves each: dense
``d x 4d`` + bias, ``4d x d`` + bias, a LayerNorm-style scale) is trained one step with
``optax.adam`` by:

- ``dp``: plain ``jax.jit`` data parallel (parameters replicated, batch over 'data');
- ``zero0``-``zero3``: ``jzero.ZeroOptimizer(tx, mesh, stage=S).train_step(loss_fn)``;
- ``user1``-``user3``: the user's own ``jax.jit`` step with ``jzero.shard_optimizer``
  (``jzero.shard_params`` first at stage 3, and each layer's parameters passed through
  ``jzero.gather(p, mesh=mesh)`` where the loss uses them, as the own-step guide says);
- ``user3_bare``: ``user3`` without that call (not in the target): the partitioner then
  reshards activations with all-to-alls instead of gathering weights, and its program is
  several times larger.

Per run: seconds to trace, lower, compile and run the first step (``first_s``: their
sum, what a user waits for), and the compiled HLO's line count. Every measurement runs in
a fresh subprocess, so no compilation cache carries over between runs; with ``--repeat``
each size is measured in rounds of every run, and each run's fastest try is kept. Target: every
run at most :data:`TARGET` x ``dp``'s ``first_s`` at every size.

    python scripts/compile_time.py --repeat 3 --json benchmarks/compile_time_cpu8.json
    python scripts/compile_time.py --quick          # one small size (~1 min)
    python scripts/compile_time.py --repeat 2 --gpu h200 --json benchmarks/compile_time_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNS = ("dp", "zero0", "zero1", "zero2", "zero3", "user1", "user2", "user3", "user3_bare")
IN_TARGET = tuple(r for r in RUNS if r != "user3_bare")  # it shows what the annotation saves
LAYERS = (8, 32, 64)  # 41, 161, 321 leaves (5 per layer, and the output scale)
TARGET = 2.0  # first_s / dp's first_s, at most


def init_params(key, *, layers: int, d: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(key, 2 * layers)
    layer = lambda k1, k2: {
        "w1": jax.random.normal(k1, (d, 4 * d)) / d**0.5,
        "b1": jnp.zeros((4 * d,)),
        "w2": jax.random.normal(k2, (4 * d, d)) / (4 * d) ** 0.5,
        "b2": jnp.zeros((d,)),
        "scale": jnp.ones((d,)),
    }
    return {
        "layers": [layer(keys[2 * i], keys[2 * i + 1]) for i in range(layers)],
        "out": jnp.ones((d,)),
    }


def loss_fn(params, batch, gather_mesh=None):
    """The mean squared error of the unrolled stack. ``gather_mesh``: the user's stage-3
    step names each layer's parameters whole where used (``jzero.gather(p, mesh=)``)."""
    import jax
    import jax.numpy as jnp

    import jzero

    whole = lambda p: p if gather_mesh is None else jzero.gather(p, mesh=gather_mesh)
    x_BxD = batch["x"]
    for p in map(whole, params["layers"]):  # unrolled: one set of leaves per layer
        h_BxD = x_BxD / jnp.sqrt(jnp.mean(x_BxD**2, -1, keepdims=True) + 1e-6) * p["scale"]
        h_BxF = jax.nn.gelu(h_BxD @ p["w1"] + p["b1"])
        # No residual: XLA:CPU copies a residual stream's chain of adds into every layer's
        # fusions, so plain jit's own HLO grows as layers squared and hides the step's.
        x_BxD = h_BxF @ p["w2"] + p["b2"]
    return jnp.mean((x_BxD * whole(params["out"]) - batch["y"]) ** 2)


def _stage(run: str) -> int:
    return 0 if run == "dp" else int(run[4])  # zeroS, userS, userS_bare


def _user_loss(run: str, mesh: Any) -> Any:
    """The loss of a user's own step: stage 3's names each layer's parameters whole."""
    return functools.partial(loss_fn, gather_mesh=mesh if run == "user3" else None)


def measure(run: str, *, layers: int, d: int, batch: int, gpu: str | None = None) -> dict:
    """One run in this process: the phases of its first step, and its HLO's size; with
    ``gpu``, compiled for 8 of those GPUs (:func:`jzero.gpu_mesh`) and not run."""
    import jax
    import optax

    import jzero

    if gpu is not None:
        return _compiled_for(jzero.gpu_mesh(gpu, devices=8), run, layers=layers, d=d, batch=batch)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jzero.data_mesh()
    tx = optax.adam(1e-3)
    init = lambda: init_params(jax.random.key(0), layers=layers, d=d)
    kx, ky = jax.random.split(jax.random.key(1))
    data = NamedSharding(mesh, P("data"))
    b = {
        "x": jax.device_put(jax.random.normal(kx, (batch, d)), data),
        "y": jax.device_put(jax.random.normal(ky, (batch, d)), data),
    }
    if run.startswith("zero"):
        opt = jzero.ZeroOptimizer(tx, mesh, stage=_stage(run))
        state = opt.init(init_fn=init)
        step, args = opt.train_step(loss_fn), (state, b)
        t0 = time.perf_counter()
        lowered = step.lower(*args)  # traces, then lowers
        t1 = time.perf_counter()
        trace_s, lower_s = None, t1 - t0
    else:
        params = jax.jit(init, out_shardings=NamedSharding(mesh, P()))()
        if run == "dp":
            opt = tx
        else:
            opt = jzero.shard_optimizer(tx, mesh, stage=_stage(run))
            params = jzero.shard_params(params, mesh) if _stage(run) == 3 else params
        args = ((params, opt.init(params)), b)

        def train_step(carry, batch):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(_user_loss(run, mesh))(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        step = jax.jit(train_step, donate_argnums=0)
        t0 = time.perf_counter()
        traced = step.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        trace_s, lower_s = t1 - t0, time.perf_counter() - t1
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    t4 = time.perf_counter()
    del jnp
    return {
        "run": run,
        "leaves": 5 * layers + 1,
        "trace_s": trace_s,  # None: jzero's step traces and lowers in one call
        "lower_s": lower_s,  # with trace_s None: trace and lower together
        "compile_s": t3 - t2,
        "run_s": t4 - t3,
        "first_s": t4 - t0,
        "hlo_lines": compiled.as_text().count("\n"),
        "lowered_lines": lowered.as_text().count("\n"),
    }


def _compiled_for(mesh: Any, run: str, *, layers: int, d: int, batch: int) -> dict[str, Any]:
    """:func:`measure` on compile-only GPUs: the state and batch as shapes, the step
    traced, lowered and compiled by XLA:GPU (nothing runs: ``first_s`` is the compile's)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jzero
    from jzero.optimizers.user_step.placement import resting_specs

    tx = optax.adam(1e-3)
    init = lambda: init_params(jax.random.key(0), layers=layers, d=d)
    rows = NamedSharding(mesh, P("data"))
    b = {k: jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=rows) for k in ("x", "y")}
    t0 = time.perf_counter()
    if run.startswith("zero"):
        opt = jzero.ZeroOptimizer(tx, mesh, stage=_stage(run))
        lowered = opt.train_step(loss_fn).lower(jax.eval_shape(*opt.init_program(init_fn=init)), b)
    else:
        shapes = jax.eval_shape(init)
        stage3 = _stage(run) == 3
        specs = resting_specs(shapes, mesh, None) if stage3 else jax.tree.map(lambda _: P(), shapes)
        at = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
        params = jax.tree.map(at, shapes, specs)
        opt = tx if run == "dp" else jzero.shard_optimizer(tx, mesh, stage=_stage(run))

        def train_step(carry, batch):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(_user_loss(run, mesh))(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        carry = (params, jax.eval_shape(opt.init, params))
        lowered = jax.jit(train_step, donate_argnums=0).trace(carry, b).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    phases = {"trace_s": None, "lower_s": t1 - t0, "compile_s": t2 - t1, "run_s": None}
    sizes = {"hlo_lines": compiled.as_text().count("\n")}
    sizes["lowered_lines"] = lowered.as_text().count("\n")
    return {"run": run, "leaves": 5 * layers + 1, **phases, "first_s": t2 - t0, **sizes}


def in_subprocess(run: str, args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """:func:`measure` in a fresh Python process (no compilation cache carries over)."""
    sizes = {"--layers": layers, "--d": args.d, "--batch": args.batch}
    options = {**sizes, "--cpu-devices": args.cpu_devices, "--gpu": args.gpu}
    cmd = [sys.executable, __file__, "--one", run]
    cmd += [str(x) for k, v in options.items() if v is not None for x in (k, v)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{run} at {layers} layers failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    sizes = (args.layers,) if args.layers else ((4,) if args.quick else LAYERS)
    runs = args.runs.split(",")
    results = []
    for layers in sizes:
        # Round after round of every run: a machine whose speed drifts slows every run
        # alike, not the ones measured last. Each run's fastest try: the least disturbed.
        rounds = [[in_subprocess(run, args, layers) for run in runs] for _ in range(args.repeat)]
        for run, tries in zip(runs, zip(*rounds)):
            r = min(tries, key=lambda r: r["first_s"])
            print(
                f"{r['leaves']:4d} leaves  {run:6s} first {r['first_s']:7.2f} s  "
                f"compile {r['compile_s']:7.2f} s  {r['hlo_lines']:7d} HLO lines",
                file=sys.stderr,
                flush=True,
            )
            results.append(r)
    return {
        "platform": f"{args.gpu} (compile only)" if args.gpu else "cpu",
        "devices": 8 if args.gpu else args.cpu_devices,
        "jax": jax.__version__,
        "jaxlib": __import__("jaxlib").__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "model": {"d": args.d, "batch": args.batch, "leaves_per_layer": 5},
        "optimizer": "adam(1e-3)",
        "repeat": args.repeat,
        "target": TARGET,
        "target_runs": [run for run in runs if run in IN_TARGET],
        "worst_ratio": worst_ratios(results),
        "runs": results,
    }


def worst_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each run's largest ``first_s`` over plain jit's at the same size."""
    dp = {r["leaves"]: r["first_s"] for r in results if r["run"] == "dp"}
    worst: dict[str, float] = {}
    for r in results:
        if r["leaves"] in dp:
            ratio = round(r["first_s"] / dp[r["leaves"]], 2)
            worst[r["run"]] = max(worst.get(r["run"], 0.0), ratio)
    return worst


def table(result: dict[str, Any]) -> str:
    """first_s per run (columns) and size (rows), and each run's ratio to dp."""
    runs = list(dict.fromkeys(r["run"] for r in result["runs"]))
    by = {(r["leaves"], r["run"]): r for r in result["runs"]}
    lines = ["leaves " + " ".join(f"{run:>14s}" for run in runs)]
    for leaves in sorted({r["leaves"] for r in result["runs"]}):
        dp = by.get((leaves, "dp"))
        cells = []
        for run in runs:
            r = by.get((leaves, run))
            ratio = f" ({r['first_s'] / dp['first_s']:.1f}x)" if r and dp else ""
            cells.append(f"{r['first_s']:.1f}s{ratio}" if r else "-")
        lines.append(f"{leaves:6d} " + " ".join(f"{c:>14s}" for c in cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", "--out", type=Path, help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="one small size (4 layers)")
    ap.add_argument("--layers", type=int, help="one size: this many layers (5 leaves each)")
    ap.add_argument("--d", type=int, default=64, help="width (layers are d x 4d, 4d x d)")
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--runs", default=",".join(RUNS), help="subset of " + ",".join(RUNS))
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes per run: the fastest")
    ap.add_argument("--cpu-devices", type=int, default=8, help="forced CPU devices")
    ap.add_argument("--gpu", help="compile for 8 of these GPUs (jzero.gpu_mesh), not run")
    ap.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # the subprocess
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = bench(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    cli = parse_args(sys.argv[1:])
    if cli.gpu:  # the GPUs are compile-only: JAX itself runs on the CPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    # A script may configure JAX (the library never does); this only shapes the CPU platform.
    jax.config.update("jax_num_cpu_devices", cli.cpu_devices)
    if cli.one:
        sizes = {"layers": cli.layers, "d": cli.d, "batch": cli.batch}
        print(json.dumps(measure(cli.one, **sizes, gpu=cli.gpu)))
    else:
        main()
