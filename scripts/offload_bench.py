"""Offload's speed and memory on the devices present: ``benchmarks/offload_cpu8.json``.

Usage: ``python scripts/offload_bench.py --json benchmarks/offload_cpu8.json`` (8 forced CPU
devices unless ``--devices``; on a GPU, the GPU). In one run:

- ``triad``: a STREAM triad (``a = b + s * c``, 12 bytes per element) on numpy arrays, on
  one thread and on as many threads as the process may use: the host's memory bandwidth.
- ``host_update``: jzero's host update alone (``Offload(optimizer="host")``'s, the
  Optax update of every leaf as host computations, donated), AdamW with bf16 parameters
  and fp32 master weights over ``--update-params`` parameters, timed as one jitted program:
  its bytes per second at 28 B per parameter (the bf16 gradient read, the fp32 master and
  two moments read and written, the bf16 parameter written), against the threads' triad
  (target: at least :data:`TRIAD_SHARE` of it). The same update on the device is timed
  beside it.
- ``modes``: the GPT of ``examples/gpt.py`` trained at stage 3 with each offload mode:
  none, the host step (exact, and delayed with ``delay=1``), streamed, and the host step
  with ``ratio`` 0.25 / 0.5 / 0.75. Per mode: the median step time, the compiled step's
  peak per memory space (``jzero.report``'s ``peak_bytes_by_space``), the bytes resting in
  host memory and their share of the optimizer state. A ratio's share is by whole leaves
  (``Offload.ratio``): the scanned GPT has few, large ones.
- ``time_split``: where each mode's step time goes, on this machine: forward and backward
  (none's step less its update), the update (timed alone, where it runs), and the rest
  (copies between memories and what the schedule could not overlap).

XLA:CPU's host and device are the same memory and cores, so on CPU the modes differ by the
work they schedule, not by a PCIe link: the GPU's figures come from
``scripts/gpu_check.sh`` (``benchmarks/gpu_check.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

TRIAD_SHARE = 0.7  # host update bytes/s over the threads' triad, at least
BYTES_PER_PARAM = 28  # AdamW, bf16 params, fp32 master: 2 + 3 x (4 + 4) + 2
RATIOS = (0.25, 0.5, 0.75)


def triad(threads: int, elements: int = 2**24, repeats: int = 10) -> float:
    """STREAM's triad on ``threads`` threads (numpy releases the GIL in its loops), in
    bytes per second (12 per element), the best of ``repeats`` (as STREAM reports)."""
    b, c = np.ones(elements, np.float32), np.full(elements, 2.0, np.float32)
    a = np.empty_like(b)
    # A block of a (512 KB) stays in a core's L2 between its two passes, and is large
    # enough that numpy's per-call cost is small beside it (2**15 elements measured
    # 18.6 / 29.0 GB/s on 1 / 2 threads here, 2**17: 23.5 / 31.2).
    block = 2**17
    bounds = np.linspace(0, elements, threads + 1).astype(int)

    def work(lo: int, hi: int) -> None:
        for i in range(lo, hi, block):
            j = min(i + block, hi)
            np.multiply(c[i:j], np.float32(3.0), out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    best = float("inf")
    for _ in range(repeats):
        pool = [threading.Thread(target=work, args=bounds[k : k + 2]) for k in range(threads)]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = min(best, time.perf_counter() - start)
    return 12 * elements / best


def _median_time(fn, carry, *args, warmup: int = 2, repeats: int = 7) -> tuple[float, Any]:
    """Median seconds of ``carry = fn(carry, *args)`` (donated carries), and the carry."""
    import jax

    times = []
    for k in range(warmup + repeats):
        start = time.perf_counter()
        carry = fn(carry, *args)
        jax.block_until_ready(carry)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), carry


def update_alone(offload: Any, params: Any) -> dict[str, float]:
    """The optimizer update of a stage-3 step alone, on made-up gradients, timed: seconds
    and bytes per second at :data:`BYTES_PER_PARAM`."""
    import jax
    import jax.numpy as jnp

    import jzero
    from jzero.core.grad_reduction import Gradients
    from jzero.core.leaf_layout import unpad
    from jzero.core.train_step import _update
    from jzero.core.updaters import make_updater

    bf16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)
    opt = jzero.ZeroOptimizer(
        optax_adamw(), jzero.data_mesh(), stage=3, precision=bf16, offload=offload
    )
    state, plan = opt.init(params), opt.plan(params)
    update = make_updater(opt.tx, opt.config)
    like = [jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=plan.sharding(s.layout.spec))
            for s in plan.params]  # fmt: skip
    reduced = [jnp.full(x.shape, 1e-3, x.dtype, device=x.sharding) for x in like]
    reduced = jax.tree.unflatten(plan.params_def, reduced)
    denominator = jnp.float32(plan.dp_size)

    def step(state, reduced):
        averaged = jax.tree.map(
            lambda g, lay: unpad(g.astype(jnp.float32) / denominator, lay),
            reduced,
            plan.params_tree(),
        )
        return _update(update, state, Gradients(reduced, denominator, averaged), None)

    seconds, _ = _median_time(jax.jit(step, donate_argnums=0), state, reduced)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {"seconds": seconds, "params": n, "bytes_per_s": BYTES_PER_PARAM * n / seconds}


def optax_adamw():
    import optax

    return optax.adamw(3e-4, weight_decay=0.1)


def _update_params(count: int) -> dict[str, Any]:
    """``count`` parameters as 8 equal [count/8/1024, 1024] leaves (sharded over 'data')."""
    import jax.numpy as jnp

    rows = max(count // 8 // 1024, 8)
    return {f"w{i}": jnp.full((rows, 1024), 0.01, jnp.float32) for i in range(8)}


def modes() -> dict[str, Any]:
    import jzero

    host = lambda **kw: jzero.Offload(optimizer="host", **kw)
    out = {"none": None, "host": host(), "host_delayed": host(delay=1, exact_steps=0)}
    out["streamed"] = jzero.Offload(optimizer="stream")
    out |= {f"ratio_{r}": host(ratio=r) for r in RATIOS}
    return out


def run_mode(name: str, offload, model: dict[str, Any], steps: int) -> dict[str, Any]:
    """One mode of the GPT at stage 3: the median step time, the peaks per memory space,
    the bytes at rest on the host, and the share of the optimizer state there."""
    import jzero

    opt = jzero.ZeroOptimizer(
        optax_adamw(), jzero.data_mesh(), stage=3, precision=model["precision"], offload=offload
    )
    with warnings.catch_warnings(record=True) as warned:  # a coarse ratio split: recorded
        warnings.simplefilter("always")
        state, step = opt.init(model["params"]), opt.train_step(model["loss_fn"])
    rep = jzero.report(step, state, model["batches"][0])
    times, losses = [], []
    for k, batch in enumerate(model["batches"][: steps + 2]):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if k >= 2:
            times.append(time.perf_counter() - start)
    plan = state.plan
    opt_kinds = [s.memory_kind for s in (*plan.opt, *(plan.master or ()))]
    sizes = [np.prod(s.shape) * s.dtype.itemsize for s in (*plan.opt, *(plan.master or ()))]
    on_host = sum(b for b, k in zip(sizes, opt_kinds) if k == "pinned_host")
    return {
        "name": name,
        "offload": repr(offload),
        "step_ms_median": 1e3 * statistics.median(times),
        "steps_timed": len(times),
        "device_peak_bytes": rep.peak_bytes_by_space["device"],
        "host_peak_bytes": rep.peak_bytes_by_space["pinned_host"],
        "host_bytes_at_rest": rep.bytes_by_memory_kind.get("pinned_host", 0),
        "host_share_of_state": on_host / sum(sizes),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "warnings": sorted({str(w.message) for w in warned}),
    }


def gpt_model(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jzero

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "examples"))
    import data  # examples/data.py: the shipped corpus
    import gpt  # examples/gpt.py

    cfg = gpt.GPTConfig(d_model=args.d_model, n_layers=args.layers, seq_len=args.seq_len)
    stream = data.batches(data.load_corpus(), batch_size=args.batch, seq_len=cfg.seq_len, seed=0)
    sharding = NamedSharding(jzero.data_mesh(), P("data"))
    batches = [
        {"tokens": jax.device_put(next(stream)["tokens"] % cfg.vocab_size, sharding)}
        for _ in range(args.steps + 2)
    ]
    params = gpt.init_params(cfg, jax.random.key(0))
    return {
        "name": f"gpt-L{cfg.n_layers}-d{cfg.d_model}-T{cfg.seq_len}",
        "params": params,
        "count": gpt.count_params(params),
        "loss_fn": gpt.make_loss_fn(cfg),
        "batches": batches,
        "precision": jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16),
    }


def time_split(runs: dict[str, dict], update: dict[str, dict], model_params: int) -> dict:
    """Per mode, milliseconds of forward + backward (none's step less its update, scaled
    to the model from the timed update's rate), update and the rest."""
    per_param = {k: v["seconds"] / v["params"] for k, v in update.items()}
    device_update = 1e3 * per_param["device"] * model_params
    host_update = 1e3 * per_param["host"] * model_params
    fwd_bwd = max(runs["none"]["step_ms_median"] - device_update, 0.0)
    out = {}
    for name, run in runs.items():
        share = run["host_share_of_state"]
        upd = share * host_update + (1 - share) * device_update
        step = run["step_ms_median"]
        out[name] = {"forward_backward_ms": fwd_bwd, "update_ms": upd,
                     "rest_ms": step - fwd_bwd - upd, "step_ms": step}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--devices", type=int, default=8, help="forced CPU devices (CPU only)")
    p.add_argument("--update-params", type=int, default=2**24)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.update_params, args.d_model, args.layers, args.steps = 2**16, 32, 2, 2
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    threads = len(os.sched_getaffinity(0))
    rates = {"threads": threads, "one_thread_bytes_per_s": triad(1)}
    rates["threads_bytes_per_s"] = triad(threads)
    import jzero

    params = _update_params(args.update_params)
    update = {
        "device": update_alone(None, params),
        "host": update_alone(jzero.Offload(optimizer="host"), params),
    }
    ratio = update["host"]["bytes_per_s"] / rates["threads_bytes_per_s"]
    model = gpt_model(args)
    runs = {name: run_mode(name, off, model, args.steps) for name, off in modes().items()}
    result = {
        "platform": jax.devices()[0].platform,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "cpu_threads": threads,
        "triad": rates,
        "host_update": {
            **update["host"],
            "device": update["device"],
            "over_triad": ratio,
            "target": TRIAD_SHARE,
        },  # fmt: skip
        "model": {
            "name": model["name"],
            "params": model["count"],
            "stage": 3,
            "precision": "bf16 params, fp32 master, bf16 reduce",
            "optimizer": "adamw",
        },  # fmt: skip
        "modes": list(runs.values()),
        "time_split": time_split(runs, update, model["count"]),
    }
    print(json.dumps({k: result[k] for k in ("triad", "host_update")}, indent=1))
    for run in runs.values():
        print(f"{run['name']:>14} {run['step_ms_median']:8.1f} ms  device peak "
              f"{run['device_peak_bytes']:>10,}  host {run['host_bytes_at_rest']:>10,} "
              f"({run['host_share_of_state']:.2f} of the state)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
