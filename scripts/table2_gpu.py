"""The ZeRO paper's Table 2 on XLA's GPU compiler: the largest GPT whose jzero train step
fits a GPU's memory, per stage, compiled for GPUs that are not here.

    JAX_PLATFORMS=cpu python scripts/table2_gpu.py --out benchmarks/table2_gpu.json
    JAX_PLATFORMS=cpu python scripts/table2_gpu.py --out /tmp/t2.json --quick   # ~2 min

For each target (:data:`TARGETS`: 64 V100-32GB over 8 hosts in fp16, the paper's, and 8
and 64 H200s in bf16) and stage 0-3, ``examples/gpt.py`` (scanned, ``nn.remat``'d blocks;
sequence 1024, one sequence per GPU, vocabulary 51200, Adam, 16-bit parameters with fp32
master weights) is compiled by XLA:GPU over :func:`jzero.gpu_mesh`'s compile-only devices,
from abstract states (``jax.eval_shape`` of ``init_program``), through
``ZeroOptimizer.train_step(loss_fn)`` with its default ``manual_gather=False``. A
compiled step's per-device memory is :data:`MEMORY_FORMULA` from ``memory_analysis()``;
it fits when at most :data:`BUDGET_FRACTION` x the spec's ``device_memory_size``.

Search, per target and stage: at each width of the stage (:func:`widths_for`) two depths
are compiled (about a half and nine tenths of the depth the paper's model-states formula
allows) and a line ``bytes = a + b * layers`` fitted through them (the blocks are one
``nn.scan``, so memory is linear in the depth and the compile time is not); the width
whose line predicts the most parameters is then searched exactly
(``max_model.largest_fitting``: from the predicted depth, compiled until a depth fits and
the next does not). Every compile is recorded with its bytes and seconds.
benchmarks/README.md documents the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT / "examples", ROOT / "scripts"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import gpt  # noqa: E402  examples/gpt.py
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from max_model import largest_fitting  # noqa: E402

import jzero  # noqa: E402
from jzero.core.gpu_target.topology import cuda_plugin, device_memory_size  # noqa: E402

MEMORY_FORMULA = (
    "argument + output - alias + temp (compiled.memory_analysis(), bytes per device: "
    "what XLA's buffer assignment needs)"
)
BUDGET_FRACTION = 0.95
SEQ_LEN = 1024
VOCAB = 51200  # GPT-2's 50257, rounded up to a multiple of 1024
HEAD_DIM = 128
LR = 1e-4


class Target(NamedTuple):
    """GPUs to compile for."""

    name: str
    gpu: str  # a jzero.gpu_mesh name
    devices: int
    hosts: int
    precision: str  # "fp16" or "bf16": the parameters' dtype (fp32 master weights)


TARGETS = (
    Target("v100x64", "v100", 64, 8, "fp16"),
    Target("h200x8", "h200", 8, 1, "bf16"),
    Target("h200x64", "h200", 64, 8, "bf16"),
)
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}

# The ZeRO paper (Rajbhandari et al., 2020), Table 2: 64 V100-32GB, 16-bit parameters and
# gradients, Adam (K = 12 bytes per parameter of fp32 states). theory: 32 GB / model-state
# bytes per parameter; measured: the largest model trained (baseline and P_os only).
PAPER_V100X64 = {
    0: {"theory": 2.0e9, "measured": 1.3e9},
    1: {"theory": 7.6e9, "measured": 6.2e9},
    2: {"theory": 14.4e9, "measured": None},
    3: {"theory": 128e9, "measured": None},
}
TARGETS_V100X64 = {0: 1.3e9, 1: 7.0e9, 2: 13e9, 3: 110e9}  # parameters, at least


def state_bytes_per_param(stage: int, n: int) -> float:
    """The paper's model-state bytes per parameter on ``n`` devices (2 + 2 + 12 for
    16-bit parameters and gradients and fp32 Adam with master weights)."""
    shard = {0: (2, 2, 12), 1: (2, 2, 12 / n), 2: (2, 2 / n, 12 / n), 3: (2 / n, 2 / n, 12 / n)}
    return sum(shard[stage])


def widths_for(target: Target, stage: int, quick: bool) -> tuple[int, ...]:
    """The widths searched: fine-grained ones where the model is small (a layer of width
    D holds 12 D^2 parameters), wider ones where a stage-3 model is large (the paper's
    model-states bound at the full device memory decides which)."""
    if quick:
        return (256,)
    model = theory_params(target, stage, device_memory_size(target.gpu))
    if model < 2e10:
        return (2048, 4096)
    if model < 2e11:
        return (4096, 6144, 7168, 8192)
    return (8192, 12288)


def theory_params(target: Target, stage: int, memory: float) -> float:
    return memory / state_bytes_per_param(stage, target.devices)


def config(width: int, layers: int, *, precision: str, seq_len: int, vocab: int):
    return gpt.GPTConfig(
        vocab_size=vocab, seq_len=seq_len, d_model=width, n_heads=max(1, width // HEAD_DIM),
        n_layers=layers, dtype=DTYPES[precision],
    )  # fmt: skip


def count_params(cfg: gpt.GPTConfig) -> int:
    init = functools.partial(gpt.init_params, cfg, jax.random.key(0))
    return gpt.count_params(jax.eval_shape(init))


def compile_bytes(mesh, target: Target, stage: int, cfg: gpt.GPTConfig) -> dict[str, Any]:
    """``cfg``'s jzero train step at ``stage`` compiled over ``mesh``: its memory analysis
    and compile seconds (tracing and lowering included)."""
    start = time.perf_counter()
    precision = jzero.Precision(param_dtype=DTYPES[target.precision])
    opt = jzero.ZeroOptimizer(optax.adam(LR), mesh, stage=stage, precision=precision)
    init = functools.partial(gpt.init_params, cfg, jax.random.key(0))
    state = jax.eval_shape(*opt.init_program(init_fn=init))
    tokens = jax.ShapeDtypeStruct(
        (target.devices, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )  # one sequence per GPU
    with _stderr_lines() as logged:
        step = opt.train_step(gpt.make_loss_fn(cfg))
        compiled = step.lower(state, {"tokens": tokens}).compile()
    m = compiled.memory_analysis()
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["seconds"] = round(time.perf_counter() - start, 2)
    # XLA:GPU's verdict beside ours: its scheduler's rematerialization logs this when the
    # program stays above its own memory limit (a share of device_memory_size)
    remat = [line for line in logged if "Can't reduce memory use below" in line]
    out["xla_remat_warning"] = remat[0].split("] ", 1)[-1] if remat else None
    return out


@contextlib.contextmanager
def _stderr_lines():
    """Collects what is written to file descriptor 2 (XLA's C++ log) meanwhile, and
    writes it on to the real stderr afterwards."""
    lines: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sys.stderr.write(text)
            lines.extend(text.splitlines())


def search_stage(
    mesh, target: Target, stage: int, *, budget: float, widths, seq_len: int, vocab: int,
    log,
) -> dict[str, Any]:  # fmt: skip
    """One stage's search over ``widths`` (see the module docstring)."""
    compiles: list[dict[str, Any]] = []
    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def measure(width: int, layers: int) -> dict[str, Any]:
        if (width, layers) not in cache:
            cfg = config(width, layers, precision=target.precision, seq_len=seq_len, vocab=vocab)
            r = compile_bytes(mesh, target, stage, cfg)
            r = {"width": width, "layers": layers, "params": count_params(cfg), **r}
            r["fits"] = r["total"] <= budget
            cache[width, layers] = r
            compiles.append(r)
            log(
                f"  {target.name} stage {stage} d{width} L{layers}: {r['params'] / 1e9:.3f} B "
                f"params, {r['total'] / 1e9:.3f} GB ({'fits' if r['fits'] else 'over'}), "
                f"{r['seconds']:.0f} s"
                + ("; XLA: over its remat limit" if r["xla_remat_warning"] else "")
            )
        return cache[width, layers]

    per_width = []
    for width in widths:
        base = count_params(config(width, 1, precision="bf16", seq_len=seq_len, vocab=vocab))
        per_layer = (
            count_params(config(width, 2, precision="bf16", seq_len=seq_len, vocab=vocab)) - base
        )
        base -= per_layer
        depth = max(4, int((theory_params(target, stage, budget) - base) / per_layer))
        lo, hi = max(1, depth // 2), max(2, int(0.9 * depth))
        a, b = measure(width, lo), measure(width, hi)
        slope = (b["total"] - a["total"]) / (hi - lo)
        intercept = a["total"] - slope * lo
        predicted = max(1, math.floor((budget - intercept) / slope)) if slope > 0 else hi
        per_width.append({
            "width": width,
            "heads": max(1, width // HEAD_DIM),
            "params_base": base,
            "params_per_layer": per_layer,
            "fit_layers": [lo, hi],
            "bytes_intercept": intercept,
            "bytes_per_layer": slope,
            "predicted_layers": predicted,
            "predicted_params": base + predicted * per_layer,
        })  # fmt: skip
    best = max(per_width, key=lambda w: w["predicted_params"])
    width = best["width"]
    known = {L: r["total"] for (w, L), r in cache.items() if w == width}
    layers, _ = largest_fitting(
        lambda L: measure(width, L)["total"], budget, best["predicted_layers"], known=known
    )
    found, nxt = cache[width, layers], cache[width, layers + 1]
    keys = ("argument", "output", "alias", "temp", "total")
    return {
        "stage": stage,
        "width": width,
        "heads": best["heads"],
        "layers": layers,
        "params": found["params"],
        "bytes": {k: found[k] for k in keys},
        "fits": found["fits"],
        "next": {
            "layers": layers + 1,
            "params": nxt["params"],
            "bytes": {k: nxt[k] for k in keys},
            "fits": nxt["fits"],
        },
        "theory_params": theory_params(target, stage, budget),
        "widths": per_width,
        "compiles": compiles,
        "compile_seconds": round(sum(r["seconds"] for r in compiles), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    targets = [t for t in TARGETS if t.name in args.targets.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    out: dict[str, Any] = {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "cuda_plugin": cuda_plugin(),
        "quick": args.quick,
        "memory_formula": MEMORY_FORMULA,
        "budget_fraction": args.fraction,
        "model": {
            "family": "examples/gpt.py: nn.scan over nn.remat'd pre-LN blocks, tied head",
            "seq_len": args.seq_len,
            "vocab": args.vocab,
            "head_dim": HEAD_DIM,
            "mlp_ratio": 4,
            "batch_per_device": 1,
            "optimizer": f"optax.adam({LR})",
            "train_step": "ZeroOptimizer.train_step(loss_fn), manual_gather=False",
        },
        "paper": {
            "source": "Rajbhandari et al., ZeRO (SC 2020), Table 2: 64 V100-32GB",
            "stages": {str(k): v for k, v in PAPER_V100X64.items()},
        },
        "targets": [],
    }
    previous = _resumable(args.resume, out)
    resumed, resumed_seconds = [], 0.0
    for target in targets:
        memory = device_memory_size(target.gpu)
        budget = args.fraction * memory
        mesh = jzero.gpu_mesh(target.gpu, devices=target.devices, hosts=target.hosts)
        entry = {
            "name": target.name,
            "gpu": target.gpu,
            "device_kind": mesh.devices.flat[0].device_kind,
            "devices": target.devices,
            "hosts": target.hosts,
            "precision": f"{target.precision} parameters and gradients, fp32 master weights "
            f"and Adam moments (jzero.Precision(param_dtype={target.precision!r}))",
            "device_memory_size": memory,
            "budget_bytes": budget,
            "stages": [],
        }
        for stage in stages:
            widths = widths_for(target, stage, args.quick)
            s = previous.get((target.name, stage, budget, widths))
            if s is not None:
                resumed.append(f"{target.name} stage {stage}")
                resumed_seconds += s["compile_seconds"]
            else:
                s = search_stage(
                    mesh, target, stage, budget=budget, widths=widths, seq_len=args.seq_len,
                    vocab=args.vocab, log=args.log,
                )  # fmt: skip
            if target.name == "v100x64" and not args.quick:
                s["paper"] = PAPER_V100X64[stage]
                s["target_params"] = TARGETS_V100X64[stage]
                s["target_met"] = s["fits"] and s["params"] >= TARGETS_V100X64[stage]
            entry["stages"].append(s)
            out["resumed"] = {"from": args.resume and str(args.resume), "stages": resumed}
            out["wall_seconds"] = round(time.perf_counter() - start + resumed_seconds, 1)
            if args.partial is not None:  # what is found so far, should the run be stopped
                args.partial(out | {"targets": [*out["targets"], entry]})
            args.log(
                f"{target.name} stage {stage}: d{s['width']} x {s['layers']} = "
                f"{s['params'] / 1e9:.2f} B params, {s['bytes']['total'] / 1e9:.2f} GB; "
                f"L+1 {s['next']['bytes']['total'] / 1e9:.2f} GB"
            )
        out["targets"].append(entry)
    out["resumed"] = {"from": args.resume and str(args.resume), "stages": resumed}
    out["wall_seconds"] = round(time.perf_counter() - start + resumed_seconds, 1)
    return out


def _resumable(path: Path | None, now: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    """The stages of an earlier run's JSON (``--resume``; a stopped run's is partial), by
    (target, stage, budget, widths): a stage searched with the same model, jax and
    widths is taken as it is rather than compiled again."""
    if path is None or not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if any(earlier[k] != now[k] for k in ("model", "jax", "jaxlib", "quick", "memory_formula")):
        return {}
    return {
        (t["name"], s["stage"], t["budget_bytes"], tuple(w["width"] for w in s["widths"])): s
        for t in earlier["targets"]
        for s in t["stages"]
    }


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: width 256, sequence 128, vocabulary 2048, stages 0 and 3 on 8 "
        "H200s, a 256 MB budget",
    )  # fmt: skip
    parser.add_argument(
        "--resume", type=Path,
        help="an earlier (or stopped) run's JSON: its stages searched with the same settings "
        "are kept, the rest compiled",
    )  # fmt: skip
    parser.add_argument("--targets", default=",".join(t.name for t in TARGETS))
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args(argv)
    args.fraction, args.seq_len, args.vocab = BUDGET_FRACTION, SEQ_LEN, VOCAB
    if args.quick:
        args.targets, args.stages, args.seq_len, args.vocab = "h200x8", "0,3", 128, 2048
        args.fraction = 256e6 / device_memory_size("h200")
    args.log = lambda line: print(line, flush=True)
    args.partial = lambda result: _write(args.out, result | {"partial": True})
    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")  # compile-only GPUs need JAX on the CPU
    result = run(args)
    _write(args.out, result)
    print(f"{args.out}: {result['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
