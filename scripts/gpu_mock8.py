"""``scripts/gpu_check.py``'s ``mock8`` piece: N = 8 on the GPU compiler without 8 GPUs.

On a GPU, the driver starts this piece's process with ``mock_num_gpu_processes`` set
(JAX mocks 8 GPUs' topology on the one present: programs compile for 8 devices but
cannot run), and each part compiles only:

- ``overlap``: stage 3 gathering per layer by itself (bench's ``zero3_auto``) and with
  prefetch (``zero3_prefetch``), under the latency-hiding scheduler; from each compiled
  schedule, how many all-gathers have compute scheduled between their start and done
  (:mod:`jzero.accounting.schedule`). Target: prefetch overlaps a larger share, above 0.
- ``dp``, ``zero1``, ``zero2``, ``zero3``: the ZeRO paper's Table 2 at N = 8: the largest
  GPT of the family whose compiled step fits :data:`TABLE2_BUDGET` per device
  (``scripts/max_model.py``'s search). Target: zero3's params >= max_model.TARGET x dp's.

Without a GPU (``--dry-run``) the parts run the same code on 8 CPU devices at tiny
sizes, and the targets are recorded as skipped: no GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import bench  # scripts/bench.py (puts examples/ and scripts/ on sys.path)
import gpt  # examples/gpt.py
import jax
import jax.numpy as jnp
import max_model  # scripts/max_model.py
from gpu_common import Context, gpt_config, skip, target
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting.estimate import transformer_activation_bytes
from jzero.accounting.schedule import collective_overlap, overlap_summary

DEVICES = 8
TABLE2 = ("dp", "zero1", "zero2", "zero3")
PARTS = ("overlap", *TABLE2)
TABLE2_BUDGET = {"gpu": "139GiB", "dry": "1.5MB"}  # per device: the lent H200's memory
SIZES = {  # overlap: the GPT compiled; table2: the family searched (fp32, adamw)
    "gpu": {
        "overlap": {"d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 256, "layers": 8,
                    "batch": DEVICES},
        "table2": {"d_model": 4096, "heads": 32, "seq_len": 1024, "vocab": 256, "batch": DEVICES},
    },
    "dry": {
        "overlap": {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "layers": 3,
                    "batch": DEVICES},
        "table2": {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "batch": DEVICES},
    },
}  # fmt: skip
NO_GPU = (
    "skipped: no GPU (mock_num_gpu_processes mocks GPUs only; the CPU figures beside it "
    "are the code path)"
)


def schedule_of(run: bench.Run, s: dict[str, int]) -> str:
    """The compiled schedule (optimized HLO text) of ``run``'s stage-3 step of the GPT at
    ``s`` over all devices, compiled from abstract values (nothing runs)."""
    cfg = gpt_config(s)
    opt = jzero.ZeroOptimizer(bench._adamw(), jzero.data_mesh(), stage=run.stage, **run.opt_options)
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(0))
    state = jax.eval_shape(*opt.init_program(init_fn=init_fn))
    sharding = NamedSharding(opt.mesh, P("data"))
    tokens = jax.ShapeDtypeStruct((s["batch"], cfg.seq_len + 1), jnp.int32, sharding=sharding)
    step = opt.train_step(gpt.make_loss_fn(cfg), **run.step_options)
    return step.lower(state, {"tokens": tokens}).compile().as_text()


def _progress(what: str, start: float) -> None:
    """A line on stderr: where a part that runs out of time was (the driver reports it)."""
    print(f"{time.perf_counter() - start:7.1f} s  {what}", file=sys.stderr, flush=True)


def overlap(ctx: Context, s: dict[str, int]) -> dict[str, Any]:
    runs, start, summaries = {r.name: r for r in bench.RUNS}, time.perf_counter(), {}
    for name in ("zero3_auto", "zero3_prefetch"):
        _progress(f"compiling {name}", start)
        summaries[name] = overlap_summary(collective_overlap(schedule_of(runs[name], s)))
    _progress("compiled", start)
    without = summaries["zero3_auto"]["overlapped_fraction"] or 0.0
    with_ = summaries["zero3_prefetch"]["overlapped_fraction"] or 0.0
    name = "mock8 prefetch overlap"
    if not ctx.gpu:
        found = skip(name, NO_GPU)
    else:
        text = f"all-gathers overlapping compute: prefetch {with_:.3f} > without {without:.3f}"
        found = target(name, with_ > without and with_ > 0, text, measured=with_, bound=without)
    return {"sizes": s, "all_gathers": summaries, "targets": [found]}


def table2(ctx: Context, entry: str, s: dict[str, int]) -> dict[str, Any]:
    """One entry of Table 2: ``max_model.bench_max_model`` for it alone."""
    budget = TABLE2_BUDGET["dry" if ctx.dry_run else "gpu"]
    args = argparse.Namespace(
        vocab=s["vocab"], seq_len=s["seq_len"], d_model=s["d_model"], heads=s["heads"],
        batch=s["batch"], seed=0, warmup=0, max_model=budget, max_model_runs=entry,
        max_model_train=0,
    )  # fmt: skip
    found = max_model.bench_max_model(args, make_tx=bench._adamw, optimizer=bench.ADAMW)
    return {"max_model": found, "stage": found["stages"][0], "targets": []}


def run(ctx: Context, part: str, earlier: dict[str, Any]) -> dict[str, Any]:
    del earlier
    s = SIZES["dry" if ctx.dry_run else "gpu"]
    if jax.device_count() != DEVICES:
        raise RuntimeError(f"mock8 needs {DEVICES} devices, found {jax.device_count()}")
    result = overlap(ctx, s["overlap"]) if part == "overlap" else table2(ctx, part, s["table2"])
    return result | {"compiler": jax.devices()[0].platform}


def targets(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """zero3 / dp params >= max_model.TARGET, once both parts ran on the GPU compiler."""
    name = "mock8 table2 zero3/dp"
    dp, z3 = parts.get("dp") or {}, parts.get("zero3") or {}
    if "stage" not in dp or "stage" not in z3:
        return [skip(name, "skipped: needs mock8:dp and mock8:zero3 (--only mock8:dp,mock8:zero3)")]
    if "gpu" not in (dp["compiler"], z3["compiler"]) or dp["compiler"] != z3["compiler"]:
        return [skip(name, NO_GPU)]
    ratio = z3["stage"]["params"] / dp["stage"]["params"]
    text = f"zero3 params / dp params at N = {DEVICES} {ratio:.2f} >= {max_model.TARGET:g}"
    return [target(name, ratio >= max_model.TARGET, text, measured=ratio, bound=max_model.TARGET)]


TABLE2_QUICK = {  # the estimator's prediction per stage, confirmed by one compile each
    "gpu": {"d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 256, "batch": DEVICES},
    "dry": {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "batch": DEVICES},
}


def _predicted_layers(args: argparse.Namespace, entry: max_model.Entry, budget: float) -> int:
    """The most layers ``jzero.estimate`` fits in ``budget`` per device (fp32, AdamW,
    activations under full checkpointing), as ``max_model``'s search starts from."""
    one, two = max_model.family_params(args, 1), max_model.family_params(args, 2)
    base, per_layer = 2 * one - two, two - one

    def est(layers: int) -> float:
        acts = 2 * transformer_activation_bytes(
            batch=max(1, args.batch // DEVICES), seq=args.seq_len, hidden=args.d_model,
            layers=layers, heads=args.heads, checkpointing=True,
        )  # fmt: skip
        return jzero.estimate(
            params=base + layers * per_layer, devices=DEVICES, stage=entry.stage,
            precision="fp32", largest_layer_params=per_layer, activation_bytes=acts,
        ).total_bytes  # fmt: skip

    layers = 1
    while est(layers * 2) <= budget and layers < max_model.MAX_LAYERS:
        layers *= 2
    lo, hi = layers, layers * 2  # est(lo) fits (or lo is 1), est(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if est(mid) <= budget else (lo, mid)
    return lo


def table2_estimate(ctx: Context) -> dict[str, Any]:
    """Table 2 at N = 8 from the estimator: per stage, the largest GPT it predicts in the
    budget, compiled once at that size (no search). Targets: each compiled peak within the
    budget, and zero3 / dp predicted params >= ``max_model.TARGET``."""
    from jzero.cli.units import parse_bytes

    key = "dry" if ctx.dry_run else "gpu"
    s, budget = TABLE2_QUICK[key], parse_bytes(TABLE2_BUDGET[key])
    args = argparse.Namespace(
        vocab=s["vocab"], seq_len=s["seq_len"], d_model=s["d_model"], heads=s["heads"],
        batch=s["batch"], seed=0, warmup=0, max_model_train=0,
    )  # fmt: skip
    stages, targets, start = {}, [], time.perf_counter()
    for entry in (e for e in max_model.ENTRIES if e.name in TABLE2):
        layers = _predicted_layers(args, entry, budget)
        _progress(f"compiling {entry.name} at {layers} layers", start)
        c = max_model.compile_step(args, entry=entry, layers=layers, batch=s["batch"],
                                   make_tx=bench._adamw)  # fmt: skip
        stages[entry.name] = {
            "layers": layers,
            "params": max_model.family_params(args, layers),
            "compiled_peak_bytes": c.peak,
            "peak_over_budget": c.peak / budget,
        }
        name = f"table2 {entry.name} fits"
        text = f"{entry.name} at the predicted {layers} layers: compiled peak / budget " \
               f"{c.peak / budget:.3f} <= 1"  # fmt: skip
        targets.append(target(name, c.peak <= budget, text, measured=c.peak / budget, bound=1.0)
                       if ctx.gpu else skip(name, NO_GPU))  # fmt: skip
    ratio = stages["zero3"]["params"] / stages["dp"]["params"]
    text = f"zero3 / dp predicted params at N = {DEVICES} {ratio:.2f} >= {max_model.TARGET:g}"
    targets.append(target("table2 zero3/dp", ratio >= max_model.TARGET, text, measured=ratio,
                          bound=max_model.TARGET)
                   if ctx.gpu else skip("table2 zero3/dp", NO_GPU))  # fmt: skip
    return {"sizes": s, "budget_bytes": budget, "stages": stages, "targets": targets,
            "compiler": jax.devices()[0].platform}  # fmt: skip
