"""The GPU check's timed pieces on the devices present: ``n1`` (stages 0-3
against plain ``jax.jit`` + Optax on one device), ``prefetch`` (stage 3 with and without
prefetch, under the latency-hiding scheduler on GPU) and ``quant`` (int8 / fp8 parameter
gathers: their error and time). Each trains ``examples/gpt.py``'s GPT through
``scripts/bench.py``'s runs (:func:`bench.run_zero`, :func:`bench.run_auto_fsdp`), so the
figures are those the benchmark reports.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import gpt  # examples/gpt.py
import jax
import jax.numpy as jnp
import numpy as np
from benchmark import runs as bench  # scripts/benchmark/runs.py
from benchmark.targets import LOSS_TOL, LOSS_TOL_DEFAULT

import jzero
from jzero.core.comm.quantize import FP8_MAX, dequantize, quantize

from .common import Context, gpt_config, random_batches, target

# Sizes per piece: "gpu" on the lent H200 (each piece a few minutes), "dry" on CPU.
# batch is global; dry pieces over 8 CPU devices need it divisible by 8.
FAMILY_GPU = {"d_model": 1024, "heads": 16, "seq_len": 1024, "vocab": 256}
FAMILY_DRY = {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256}
SIZES = {
    "n1": {
        "gpu": FAMILY_GPU | {"layers": 8, "batch": 8, "warmup": 3, "steps": 30, "rounds": 2},
        "dry": FAMILY_DRY | {"layers": 2, "batch": 2, "warmup": 1, "steps": 2, "rounds": 1},
    },
    "prefetch": {
        "gpu": FAMILY_GPU | {"layers": 8, "batch": 8, "warmup": 3, "steps": 20},
        "dry": FAMILY_DRY | {"layers": 3, "batch": 8, "warmup": 1, "steps": 2},
    },
    "quant": {
        "gpu": FAMILY_GPU | {"layers": 8, "batch": 8, "warmup": 3, "steps": 20},
        "dry": FAMILY_DRY | {"layers": 2, "batch": 8, "warmup": 1, "steps": 2},
    },
}
N1_TIME = 1.02  # jzero's step time / plain jit + Optax's, at most, every stage (bf16)
SAME_LOSS = LOSS_TOL_DEFAULT  # prefetch's first loss vs without: the same program's
QUANT_LOSS = LOSS_TOL["zero3_int8"]  # a quantized gather's first loss vs exact
RUNS = {r.name: r for r in bench.RUNS}


def sizes(piece: str, ctx: Context) -> dict[str, int]:
    return SIZES[piece]["dry" if ctx.dry_run else "gpu"]


def _setup(s: dict[str, int], mesh, *, dtype=jnp.float32):
    """``(init_fn, loss_fn, batches)`` of the family's GPT at ``s`` on ``mesh``."""
    cfg = gpt_config(s, dtype=dtype)
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(0))
    count = s["warmup"] + s["steps"]
    return init_fn, gpt.make_loss_fn(cfg), random_batches(mesh, cfg, batch=s["batch"], count=count)


def _trained(run: bench.Run, mesh, setup, warmup: int) -> dict[str, Any]:
    """bench's fields of one run (plain jit when ``run.step_options`` is None)."""
    measure = bench.run_zero if run.step_options is not None else bench.run_auto_fsdp
    return measure(run, bench.adamw(), mesh, *setup, warmup)


def n1(ctx: Context) -> dict[str, Any]:
    """Stages 0-3 against plain ``jax.jit`` + Optax on one device, the GPT computing in
    bf16 (parameters and Adam state fp32 in both): each program timed ``rounds`` times,
    in order and then reversed, its best median kept."""
    s = sizes("n1", ctx)
    mesh = jzero.data_mesh(jax.devices()[:1])
    setup = _setup(s, mesh, dtype=jnp.bfloat16)
    runs = [bench.Run("plain_jit", 3, None)]
    runs += [bench.Run(f"stage{k}", k, bench.MANUAL) for k in range(4)]
    best: dict[str, dict[str, Any]] = {}
    for r in range(s["rounds"]):
        for run in runs if r % 2 == 0 else runs[::-1]:
            fields = _trained(run, mesh, setup, s["warmup"])
            if run.name not in best or fields["step_ms_median"] < best[run.name]["step_ms_median"]:
                best[run.name] = fields
    base = best["plain_jit"]["step_ms_median"]
    targets = []
    for run in runs[1:]:
        ratio = best[run.name]["step_ms_median"] / base
        text = f"{run.name} step time / plain jit {ratio:.3f} <= {N1_TIME}"
        targets.append(target(f"n1 {run.name} time", ratio <= N1_TIME, text,
                              measured=ratio, bound=N1_TIME))  # fmt: skip
    return {
        "sizes": s,
        "compute_dtype": "bfloat16",
        "runs": list(best.values()),
        "targets": targets,
    }


def prefetch(ctx: Context) -> dict[str, Any]:
    """Stage 3 gathering per layer by itself, with and without ``prefetch`` (bench's
    ``zero3_auto`` and ``zero3_prefetch``), over all devices; the driver turns on XLA's
    latency-hiding scheduler on GPU. Target: the same first loss (prefetch changes when
    layers are gathered, not the values). Step times are figures (one GPU has no
    all-gather to hide; tests/core/gpu_target/test_compiled_for_gpus.py reads the schedule
    compiled for 8 H200s without them)."""
    s = sizes("prefetch", ctx)
    mesh = jzero.data_mesh()
    setup = _setup(s, mesh)
    off = _trained(RUNS["zero3_auto"], mesh, setup, s["warmup"])
    on = _trained(RUNS["zero3_prefetch"], mesh, setup, s["warmup"])
    diff = abs(on["loss_first"] - off["loss_first"]) / abs(off["loss_first"])
    text = f"prefetch first loss rel. diff vs without {diff:.2e} <= {SAME_LOSS:g}"
    ok = diff <= SAME_LOSS
    figures = {
        "step_ms_without": off["step_ms_median"],
        "step_ms_with": on["step_ms_median"],
        "time_ratio": on["step_ms_median"] / off["step_ms_median"],
        "peak_bytes_without": off["peak_bytes_per_device"],
        "peak_bytes_with": on["peak_bytes_per_device"],
    }
    return {
        "sizes": s,
        "devices": mesh.shape["data"],
        "figures": figures,
        "runs": [off, on],
        "targets": [target("prefetch same loss", ok, text, measured=diff, bound=SAME_LOSS)],
    }


ROUNDING = 1 + 2**-15
"""The quantizers' documented bounds hold up to fp32's rounding of ``x / scale``: within
2 ulp (XLA:GPU divides approximately) of a value below 128, whose ulp is 2**-17, so half a
step grows by at most 2 * 2**-17 / (1/2) = 2**-15 of itself (H200, jax 0.11.2: int8
measured 1 + 1.8e-5)."""


def _quant_run(dtype: str) -> bench.Run:
    """bench's ``zero3_int8`` with gathers in ``dtype`` (``'int8'`` or ``'fp8'``)."""
    base = RUNS["zero3_int8"]
    comm = dataclasses.replace(base.opt_options["comm"], gather_quant=dtype)
    return base._replace(name=f"zero3_{dtype}", opt_options=base.opt_options | {"comm": comm})


def roundtrip_error(params: Any, *, dtype: str, block: int) -> float:
    """The largest ``|x - dequantize(quantize(x))|`` over every parameter, each leaf cut
    into blocks of ``block`` elements, as a share of the documented bound (int8: half a
    step, absmax / 254; fp8: ``max(|x| / 16, absmax / 458752)``): at most 1 when the
    quantizer keeps its promise."""
    levels = 127 if dtype == "int8" else FP8_MAX
    worst = 0.0
    for leaf in jax.tree.leaves(params):
        x = jnp.ravel(leaf).astype(jnp.float32)[None]
        q, scale = quantize(x, block=block, dtype=dtype)
        err = jnp.abs(dequantize(q, scale, size=x.size, dtype=jnp.float32) - x)
        absmax = jnp.repeat(scale * levels, q.shape[-1])[: x.size].reshape(x.shape)
        fp8_bound = jnp.maximum(jnp.abs(x) / 16, absmax / 458752)
        bound = absmax / 254 if dtype == "int8" else fp8_bound
        safe = jnp.where(bound > 0, bound, 1.0)
        ratio = jnp.where(bound > 0, err / safe, jnp.where(err > 0, np.inf, 0.0))
        worst = max(worst, float(jnp.max(ratio)))
    return worst


def quant(ctx: Context) -> dict[str, Any]:
    """Stage 3 with exact, int8 and fp8 parameter all-gathers over all devices. Targets per
    dtype: the quantizer's round trip on the model's initial parameters within its
    documented bound times :data:`ROUNDING`, and the first loss within bench's
    ``zero3_int8`` tolerance of the exact gather's. Step times and gathered bytes are
    figures."""
    s = sizes("quant", ctx)
    mesh = jzero.data_mesh()
    setup = _setup(s, mesh)
    exact = _trained(RUNS["zero3"], mesh, setup, s["warmup"])
    params = setup[0]()
    figures, runs, targets = {}, [exact], []
    for dtype in ("int8", "fp8"):
        run = _quant_run(dtype)
        fields = _trained(run, mesh, setup, s["warmup"])
        err = roundtrip_error(params, dtype=dtype, block=run.opt_options["comm"].quant_block)
        diff = abs(fields["loss_first"] - exact["loss_first"]) / abs(exact["loss_first"])
        figures[dtype] = {
            "roundtrip_error_over_bound": err,
            "loss_first_rel_diff": diff,
            "time_ratio": fields["step_ms_median"] / exact["step_ms_median"],
            "all_gather_bytes_by_dtype": fields["all_gather_bytes_by_dtype"],
        }
        runs.append(fields)
        targets += [
            target(f"quant {dtype} error", err <= ROUNDING,
                   f"{dtype} round-trip error / bound {err:.6f} <= {ROUNDING:.6f}",
                   measured=err, bound=ROUNDING),
            target(f"quant {dtype} loss", diff <= QUANT_LOSS,
                   f"{dtype} first loss rel. diff vs exact {diff:.2e} <= {QUANT_LOSS:g}",
                   measured=diff, bound=QUANT_LOSS),
        ]  # fmt: skip
    return {"sizes": s, "devices": mesh.shape["data"], "figures": figures, "runs": runs,
            "targets": targets}  # fmt: skip
