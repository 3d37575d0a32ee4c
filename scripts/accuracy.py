"""Accuracy over seeds: the example LM trained exactly and with each lossy or reordering option.

Trains the GPT of ``examples/gpt.py`` on the shipped corpus (``examples/data.py``) at
stage 3 over all devices (every leaf sharded, ``min_shard_size=1``, ``manual_gather=True``)
with ``examples/train_lm.py``'s optimizer (``--optimizer``: clipped AdamW on a warmup and
cosine decay, or constant-rate AdamW, or SGD with momentum), once per seed and variant:

- ``exact``: fp32 all-gathers and reduce-scatters, the reference;
- ``int8_gather``: ``Communication(gather_quant="int8")`` (ZeRO++'s qwZ);
- ``fp8_gather``: ``Communication(gather_quant="fp8")`` (float8_e4m3fn, the same bytes);
- ``int8_grad`` / ``int4_grad``: ``Communication(grad_quant=...)`` (ZeRO++'s qgZ);
- ``offload``: ``offload="optimizer"`` (the same update equations, run leaf by leaf);
- ``prefetch``: ``Communication(prefetch=True)`` with ``manual_gather=False`` (the same
  arithmetic gathered another way: only summation orders may change).

Every variant uses the same seeds; seed ``s`` draws the initial parameters from
``jax.random.key(s)`` and the batches from ``data.batches(..., seed=s)``. A run's final
loss is the mean of its last ``--last`` training losses. Per variant the JSON holds each
seed's final loss and its relative difference from the exact run of that seed,
``(variant - exact) / exact``, with their mean, sample standard deviation (n - 1), min and
max, and how many seeds' whole loss curves equal the exact ones bit for bit.

A single run is no measurement: a few hundred AdamW steps at lr 1e-2 on this model are
chaotic (``scripts/sensitivity.py``), so two programs that round differently (another CPU,
another summation order, quantization) end at visibly different losses. Compare the
variants' spread with the ``prefetch`` row, whose only difference from ``exact`` is
rounding.

    python scripts/accuracy.py --json benchmarks/accuracy_cpu8.json   # 8 seeds x 7 variants
    python scripts/accuracy.py --optimizer adamw --json benchmarks/accuracy_adamw_cpu8.json
    python scripts/accuracy.py --seeds 16 --variants exact,int8_grad

The default run costs about 9 CPU-minutes (XLA:CPU, 8 forced devices on a 2-core x86 VM);
the JSON also records the corpus's size and SHA-256, so rerun it when examples/data changes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

import jzero

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import data  # noqa: E402  (examples/data.py: bytes of a small public-domain corpus)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402  (examples/gpt.py)
from benchmark.runs import json_options as options_json  # noqa: E402


class Variant(NamedTuple):
    """One way of training: ZeroOptimizer and train_step keywords beyond the exact run's."""

    name: str
    opt_options: dict[str, Any]
    step_options: dict[str, bool]


class Optimizer(NamedTuple):
    """An Optax optimizer as a function of the (peak) learning rate and the run's steps."""

    make: Callable[[float, int], optax.GradientTransformation]
    lr: float  # the default learning rate
    text: str  # its description, {lr} filled in


def train_lm_recipe(lr: float, steps: int) -> optax.GradientTransformation:
    """examples/train_lm.py's optimizer: global-norm clipping at 1.0, then AdamW (weight
    decay 0.1) on a linear warmup over a tenth of the steps and a cosine decay to 0."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=max(1, steps // 10), decay_steps=steps
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


OPTIMIZERS = {
    "train_lm": Optimizer(
        train_lm_recipe, 1e-2, "clip 1.0 + adamw(warmup-cosine to {lr:g}, wd=0.1)"
    ),
    "adamw": Optimizer(
        lambda lr, _: optax.adamw(lr, weight_decay=0.1), 1e-2, "adamw({lr:g}, wd=0.1)"
    ),
    "sgd": Optimizer(lambda lr, _: optax.sgd(lr, momentum=0.9), 0.1, "sgd({lr:g}, momentum=0.9)"),
}

MANUAL = {"manual_gather": True}
VARIANTS = (
    Variant("exact", {}, MANUAL),
    Variant("int8_gather", {"comm": jzero.Communication(gather_quant="int8")}, MANUAL),
    Variant("fp8_gather", {"comm": jzero.Communication(gather_quant="fp8")}, MANUAL),
    Variant("int8_grad", {"comm": jzero.Communication(grad_quant="int8")}, MANUAL),
    Variant("int4_grad", {"comm": jzero.Communication(grad_quant="int4")}, MANUAL),
    Variant("offload", {"offload": "optimizer"}, MANUAL),
    Variant("prefetch", {"comm": jzero.Communication(prefetch=True)}, {"manual_gather": False}),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [v.name for v in VARIANTS]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the per-seed figures here")
    ap.add_argument("--seeds", type=int, default=8, help="seeds 0 .. N-1 (default 8)")
    ap.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    ap.add_argument("--last", type=int, default=20, help="final loss: mean of the last N")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="train_lm",
        help="train_lm: examples/train_lm.py's clipped AdamW on warmup + cosine decay "
        "(default); adamw: optax.adamw(lr, weight_decay=0.1), constant; sgd: optax.sgd(lr, "
        "momentum=0.9)",
    )
    ap.add_argument("--lr", type=float, help="(peak) learning rate (default 1e-2; sgd 0.1)")
    ap.add_argument("--variants", default=",".join(names), help=f"subset of {names}")
    ap.add_argument("--cpu-devices", type=int, default=8, help="forced CPU devices")
    args = ap.parse_args(argv)
    wanted = args.variants.split(",")
    if "exact" not in wanted or set(wanted) - set(names):
        ap.error(f"--variants: a subset of {names} that includes exact, got {args.variants!r}")
    if args.seeds < 1 or args.steps < 1 or not 1 <= args.last <= args.steps:
        ap.error("--seeds and --steps must be >= 1 and --last between 1 and --steps")
    if args.lr is None:
        args.lr = OPTIMIZERS[args.optimizer].lr
    return args


def train(opt, step, cfg, args, seed: int) -> list[float]:
    """Every step's loss of one run from seed ``seed``."""
    state = opt.init(init_fn=functools.partial(gpt.init_params, cfg, jax.random.key(seed)))
    batches = data.batches(
        data.load_corpus(), batch_size=args.batch, seq_len=cfg.seq_len, seed=seed
    )
    losses = []
    for _ in range(args.steps):
        state, metrics = step(state, next(batches))
        losses.append(float(metrics["loss"]))
    return losses


def run_variant(variant: Variant, cfg, args) -> list[list[float]]:
    """Each seed's loss curve; one optimizer and compiled step for all seeds."""
    tx = OPTIMIZERS[args.optimizer].make(args.lr, args.steps)
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(tx, mesh, stage=3, min_shard_size=1, **variant.opt_options)
    step = opt.train_step(gpt.make_loss_fn(cfg), **variant.step_options)
    return [train(opt, step, cfg, args, seed) for seed in range(args.seeds)]


def summary(curves: list[list[float]], exact: list[list[float]], last: int) -> dict[str, Any]:
    """Per-seed final losses and their relative differences from the exact runs'."""
    final = [float(np.mean(c[-last:])) for c in curves]
    ref = [float(np.mean(c[-last:])) for c in exact]
    rel = [(f - e) / e for f, e in zip(final, ref)]
    spread = statistics.stdev(rel) if len(rel) > 1 else 0.0
    return {
        "final_losses": final,
        "first_losses": [c[0] for c in curves],
        "rel_diff": rel,
        "rel_diff_mean": statistics.fmean(rel),
        "rel_diff_std": spread,
        "rel_diff_min": min(rel),
        "rel_diff_max": max(rel),
        "curves_equal_exact": sum(c == e for c, e in zip(curves, exact)),
    }


def json_options(variant: Variant) -> dict[str, Any]:
    """The variant's keywords, JSON-able: option objects as their non-default fields."""
    return options_json(variant.step_options, variant.opt_options, block=False)


def cpu_name() -> str:
    """The CPU model (Linux: /proc/cpuinfo), which changes how XLA:CPU rounds."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def corpus_identity() -> dict[str, Any]:
    """The training text's size and SHA-256: the figures belong to this corpus."""
    corpus = data.load_corpus()
    return {
        "corpus_bytes": int(corpus.size),
        "sha256": hashlib.sha256(corpus.tobytes()).hexdigest(),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = gpt.GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers
    )
    wanted = args.variants.split(",")
    curves, seconds = {}, {}
    for variant in VARIANTS:
        if variant.name in wanted:
            start = time.perf_counter()
            curves[variant.name] = run_variant(variant, cfg, args)
            seconds[variant.name] = time.perf_counter() - start
            print(f"{variant.name}: {seconds[variant.name]:.0f} s", file=sys.stderr)
    variants = [
        {"name": v.name, "options": json_options(v), "seconds": seconds[v.name],
         **summary(curves[v.name], curves["exact"], args.last)}
        for v in VARIANTS if v.name in wanted
    ]  # fmt: skip
    like = jax.eval_shape(functools.partial(gpt.init_params, cfg, jax.random.key(0)))
    return {
        "platform": jax.devices()[0].platform,
        "cpu": cpu_name(),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "model": {
            "name": f"gpt-L{cfg.n_layers}-d{cfg.d_model}-h{cfg.n_heads}-T{cfg.seq_len}"
            f"-V{cfg.vocab_size}",
            "params": gpt.count_params(like),
        },
        "data": corpus_identity(),
        "settings": {
            "stage": 3,
            "optimizer": args.optimizer,
            "optimizer_text": OPTIMIZERS[args.optimizer].text.format(lr=args.lr),
            "batch": args.batch,
            "steps": args.steps,
            "final": f"mean of the last {args.last} training losses",
            "seeds": list(range(args.seeds)),
        },
        "variants": variants,
    }


def table(result: dict[str, Any]) -> str:
    """One line per variant: mean final loss and (variant - exact) / exact over the seeds."""
    s = result["settings"]
    head = (
        f"{result['model']['name']}, {s['optimizer_text']}, {s['steps']} steps, "
        f"{len(s['seeds'])} seeds, {result['cpu']}"
    )
    lines = [head, "variant       final (mean)  rel. diff mean ± std    [min, max]  equal"]
    for v in result["variants"]:
        lines.append(
            f"{v['name']:<13} {statistics.fmean(v['final_losses']):12.4f}  "
            f"{v['rel_diff_mean']:+.2e} ± {v['rel_diff_std']:.1e}  "
            f"[{v['rel_diff_min']:+.1e}, {v['rel_diff_max']:+.1e}]  "
            f"{v['curves_equal_exact']}/{len(v['rel_diff'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    # A script may configure JAX (the library never does); this only shapes the CPU platform.
    cli = parse_args(sys.argv[1:])
    jax.config.update("jax_num_cpu_devices", cli.cpu_devices)
    main()
