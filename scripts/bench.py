"""Benchmark: ZeRO stages 0-3 and a plain-``jit`` FSDP baseline on the same GPT-style model.

Trains the model of ``examples/gpt.py`` under DP (stage 0), ZeRO stages 1-3 (jzero,
``manual_gather=True``), six more stage-3 runs (``zero3_bucket``: ``Communication(bucket=True)``,
one flat collective per layer; ``zero3_auto``: ``manual_gather=False``, the step gathering per
layer by itself; ``zero3_prefetch``: that with ``Communication(prefetch=True)``, activations kept;
``zero3_int8``: ``Communication(gather_quant="int8")``, int8 all-gathers with fp32 block scales;
``zero3_qgz``: ``Communication(grad_quant="int8")``, gradient reduce-scatters as int8
all-to-alls with fp32 block scales; ``zero3_offload``: ``offload="optimizer"``, optimizer
state in ``pinned_host``) and ``auto_fsdp`` (``jax.jit`` with parameters and optimizer
state given ``NamedSharding``s over 'data', XLA choosing the collectives) and
``user_zero1``-``user_zero3`` (the user's own ``jax.jit`` step with
``jzero.shard_optimizer``, XLA choosing the collectives and the outputs' layout), with the same
initial parameters, data and ``optax.adamw``, and reports per device: model-state bytes
(live arrays), compiled peak bytes, communication per step (optimized HLO, ring model),
collectives per step and step time, each beside docs/design.md §1's theory where there is one.

    python scripts/bench.py                        # readable table
    python scripts/bench.py --json out.json        # docs/design.md §5's JSON
    python scripts/bench.py --quick                # small model, few steps (~20 s)
    python scripts/bench.py --checkpoint-only      # checkpoint throughput alone (~1 min)
    python scripts/bench.py --matrices --json benchmarks/matrices_cpu8.json  # Muon vs AdamW
    python scripts/bench.py --max-model 64MB       # largest model per stage (compile only)
    python scripts/bench.py --max-model 64MB --max-model-train 5   # ... then train each

``--quick`` checks only the design targets that hold at any model size (model states and
dp/zero1/zero2 communication against theory, zero3_bucket's collectives per layer, final
losses against dp, zero3's variants against zero3, zero3_offload's host bytes); the peak,
step-time, zero3-communication, zero3_int8 all-gather and zero3_qgz all-to-all targets
need the full-size model and are skipped, saying so. Offload's step time has no target
here: on CPU host memory is the same RAM, so its cost or benefit is a GPU question.

Checkpoint throughput (``--checkpoint``, on by default, off under ``--quick`` unless given;
``--checkpoint-only`` skips the training runs): a separate GPT of at least
``--checkpoint-mb`` MB of model states (params + Adam state, fp32; default 300) is trained
one step at stage 3, then, each repetition in a fresh temporary directory, timed with
``time.perf_counter``: an async ``jzero.Checkpointer.save`` until it returns (the
device-to-host copy) and until ``wait()`` returns, ``restore`` into the same layout and into
stage 1 on half the devices, and ``export_safetensors``. One untimed warm-up repetition
first (it compiles); the medians of ``--checkpoint-reps`` more are reported as MB/s of the
true (unpadded) state bytes, MB = 1e6 (the export: of the parameters' bytes, all it writes).
No targets: the figures depend on the machine.

Matrix optimizers (``--matrices``, alone; ``scripts/benchmark/matrices.py``): Muon
(``gpt.muon``) against AdamW on the same GPT, scanned and unrolled, at stages 1-3, in
jzero's step and the user's: collective bytes, matmul FLOPs per device, the compiled peak,
step time, and Muon's ratios to AdamW's, with the Newton-Schulz FLOPs per device over
1/N of one device's.

Largest model (``--max-model BUDGET``, alone; ``scripts/max_model.py``): the ZeRO paper's
Table 2 and ZeRO-Offload's claim, measured. For DP, stages 1-3, and stage 3 streamed
(``zero3_offload``), with the host step (``zero3_host``), in bf16 with fp32 master weights
(``zero3_bf16``) and with the host step in bf16 (``zero3_bf16_host``), over all devices
(``--max-model-runs``: a subset), the most layers of ``examples/gpt.py`` at a fixed width
(``--d-model``, default 128; ``--heads``, ``--seq-len``, ``--vocab``; global ``--batch``,
default one sequence per device; ``adamw``) whose jzero train step
(``manual_gather=True``) compiles to a device peak <= BUDGET per device (the compiled
program's peak by memory space, ``jzero.accounting.memory_spaces``: host memory apart on
any backend), found by compiling only (abstract states from ``jax.eval_shape`` of
``init_program``), from the estimator's guess, then doubling and bisection. Reported
beside ``jzero.max_params`` for the same budget. Targets: zero3's params >= 7 x dp's;
zero3_host >= 1.8 x zero3's, zero3_bf16_host >= 3.5 x zero3_bf16's, zero3_offload >= 1.8 x
zero3's; the stage-3 estimates within 10 %. ``--max-model-train STEPS`` then trains each
found model on the devices (``--warmup`` + STEPS steps, random tokens) for its time per
step and per token. On one GPU, ``--max-model-runs zero3,zero3_host`` (every stage holds
the same bytes on one device); benchmarks/README.md has the command.

Without an accelerator it runs on 8 forced CPU devices (``--cpu-devices``). Field notes:

- ``model_state_bytes_per_device``: params + optimizer state read from the live arrays'
  first addressable shard, plus gradients derived from the sharding plan (they are not
  alive between steps): full in stages 0/1, a shard in stages 2/3; ``auto_fsdp``: a shard
  like its parameter. ``auto_fsdp``'s theory is stage 3's (it is FSDP). ``user_zero*``:
  gradients whole at stage 1, a shard at stages 2-3; their final loss is checked against
  ``zero1``-``zero3``'s.
- ``peak_bytes_per_device``: argument + output + temp - alias of ``memory_analysis()``
  (XLA:CPU: one memory, host buffers included). ``device_peak_bytes_per_device``,
  ``host_peak_bytes_per_device``: the compiled step's peak per memory space
  (``report(...).peak_bytes_by_space``: on CPU the schedule replayed with host buffers
  apart, ``jzero.accounting.memory_spaces``; on a GPU XLA's own per-space figures).
- ``collectives_per_step``: the HLO collectives times their trip counts, a combined
  (tuple-shaped) one counted once. ``options``: the run's ``train_step`` keywords
  (``manual_gather``, ``bucket``, ``prefetch``) and any ``ZeroOptimizer`` keywords it adds
  (``precision``, ``comm``: the fields that differ from their defaults, with ``quant_block`` when
  it quantizes; ``offload``); ``{}`` for ``auto_fsdp``.
- ``host_bytes_per_device``: the live params + optimizer state + master weights resting
  outside device memory (``report(...).bytes_by_memory_kind``; 0 when none).
- ``all_gather_bytes_by_dtype``: ``comm_bytes_per_device["all-gather"]`` by HLO element
  type (``s8``: quantized gathers, ``f32`` beside them: their scales).
  ``all_to_all_bytes_by_dtype``: the all-to-alls (in ``comm_bytes_per_device["other"]``)
  likewise (``s8``: zero3_qgz's quantized gradient parts, ``f32``: their scales).
- Scalar all-reduces (loss mean, gradient norm) are included in the measured bytes.
- On CPU, XLA runs 16-bit collectives in f32: measured bytes of a bf16 model are 2x.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.cli.units import parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (examples/data.py: bytes of a small public-domain corpus)
import gpt  # noqa: E402  (examples/gpt.py)
import max_model  # noqa: E402  (scripts/max_model.py: --max-model)
from benchmark.checkpoints import bench_checkpoint, checkpoint_table  # noqa: E402
from benchmark.matrices import bench_matrices, matrices_table  # noqa: E402
from benchmark.runs import ADAMW, RUNS, adamw, run_auto_fsdp, run_user_step, run_zero  # noqa: E402
from benchmark.tables import table  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write docs/design.md §5's JSON here")
    ap.add_argument(
        "--quick", action="store_true", help="small model, few steps, size-independent targets"
    )
    ap.add_argument("--layers", type=int, help="transformer blocks (default 8; quick 2)")
    ap.add_argument("--d-model", type=int, help="width (default 256; quick 64)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 64; quick 32)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, help="global batch (default 16; quick 16)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, help="timed steps (default 20; quick 5)")
    ap.add_argument("--runs", default=",".join(r.name for r in RUNS), help="subset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-devices", type=int, default=8, help="forced CPU devices")
    ap.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        help="measure checkpoint save/restore/export throughput (default: on; off with --quick)",
    )
    ap.add_argument(
        "--checkpoint-only", action="store_true", help="only the checkpoint measurement"
    )
    ap.add_argument(
        "--checkpoint-mb",
        type=float,
        default=300.0,
        help="model states (params + Adam state) of the checkpointed model, at least this "
        "many MB (1e6 bytes; default 300)",
    )
    ap.add_argument(
        "--checkpoint-reps", type=int, default=3, help="timed repetitions (median; default 3)"
    )
    ap.add_argument(
        "--matrices",
        action="store_true",
        help="only Muon against AdamW on the example GPT, scanned and unrolled, stages 1-3, "
        "jzero's step and the user's (scripts/benchmark/matrices.py)",
    )
    ap.add_argument(
        "--max-model",
        metavar="BUDGET",
        help="only the largest-model search: per stage, the most layers (width --d-model, "
        "default 128) whose compiled step fits BUDGET per device (e.g. 64MB), compiling only",
    )
    entries = [e.name for e in max_model.ENTRIES]
    ap.add_argument(
        "--max-model-runs",
        help=f"--max-model's subset of {','.join(entries)} (default: all; one GPU: "
        "zero3,zero3_offload)",
    )
    ap.add_argument(
        "--max-model-train",
        metavar="STEPS",
        type=int,
        default=0,
        help="after --max-model's search, train each found model --warmup + STEPS steps on "
        "the devices and report the median time per step and per token (default 0: no)",
    )
    args = ap.parse_args(argv)
    unknown = set(args.runs.split(",")) - {r.name for r in RUNS}
    if unknown:
        ap.error(f"--runs: unknown {sorted(unknown)}; choose from {[r.name for r in RUNS]}")
    if args.max_model is None and (args.max_model_train or args.max_model_runs is not None):
        ap.error("--max-model-runs and --max-model-train need --max-model BUDGET")
    args.max_model_runs = args.max_model_runs or ",".join(entries)
    unknown = set(args.max_model_runs.split(",")) - set(entries)
    if unknown:
        ap.error(f"--max-model-runs: unknown {sorted(unknown)}; choose from {entries}")
    if args.max_model is not None:
        if args.checkpoint_only or args.checkpoint or args.quick:
            ap.error("--max-model runs alone: drop --checkpoint/--checkpoint-only/--quick")
        try:
            parse_bytes(args.max_model)
        except ValueError as e:
            ap.error(f"--max-model: {e}")
        if args.max_model_train < 0:
            ap.error(f"--max-model-train must be >= 0 steps, got {args.max_model_train}")
        defaults = {"d_model": 128, "seq_len": 64}  # batch: one sequence per device
        for key, value in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        args.checkpoint = False
        return args
    if args.checkpoint_only and args.checkpoint is False:
        ap.error("--checkpoint-only contradicts --no-checkpoint")
    if args.checkpoint is None:
        args.checkpoint = args.checkpoint_only or not args.quick
    if args.checkpoint_mb <= 0 or args.checkpoint_reps < 1:
        ap.error("--checkpoint-mb must be > 0 and --checkpoint-reps >= 1")
    quick = {"layers": 2, "d_model": 64, "seq_len": 32, "batch": 16, "steps": 5}
    full = {"layers": 8, "d_model": 256, "seq_len": 64, "batch": 16, "steps": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_model is not None:
        return {
            "platform": jax.devices()[0].platform,
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "max_model": max_model.bench_max_model(args, make_tx=adamw, optimizer=ADAMW),
        }
    if args.matrices:
        return bench_matrix_optimizers(args)
    if args.checkpoint_only:
        return {
            "platform": jax.devices()[0].platform,
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "checkpoint": bench_checkpoint(args),
        }
    mesh = jzero.data_mesh()
    n = mesh.shape["data"]
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
        n_heads=args.heads, n_layers=args.layers, dtype=jnp.float32,
    )  # fmt: skip
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(args.seed))
    loss_fn = gpt.make_loss_fn(cfg)
    tx = adamw()
    stream = data.batches(
        data.load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed
    )
    data_sharding = NamedSharding(mesh, P("data"))
    batches = [  # the same batches, already on the devices, for every run
        {"tokens": jax.device_put(next(stream)["tokens"] % args.vocab, data_sharding)}
        for _ in range(args.warmup + args.steps)
    ]
    # The user's own step gathers each layer where it uses it (jzero.gather(..., mesh=)).
    user_loss_fn = gpt.make_loss_fn(dataclasses.replace(cfg, gather_mesh=mesh))
    wanted = args.runs.split(",")
    runs = []
    for run in RUNS:
        if run.name in wanted and run.user_step:
            runs.append(run_user_step(run, tx, mesh, init_fn, user_loss_fn, batches, args.warmup))
        elif run.name in wanted:
            measure = run_zero if run.step_options is not None else run_auto_fsdp
            runs.append(measure(run, tx, mesh, init_fn, loss_fn, batches, args.warmup))
    name = f"gpt-L{cfg.n_layers}-d{cfg.d_model}-h{cfg.n_heads}-T{cfg.seq_len}-V{cfg.vocab_size}"
    return {
        "platform": jax.devices()[0].platform,
        "devices": n,
        "jax": jax.__version__,
        "model": {
            "name": name,
            "params": int(gpt.count_params(jax.eval_shape(init_fn))),
            "layers": cfg.n_layers,
            "dtype": jnp.dtype(cfg.dtype).name,
        },
        "settings": {
            "batch": args.batch,
            "seq_len": args.seq_len,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": args.seed,
            "optimizer": ADAMW,
        },  # fmt: skip
        "runs": runs,
        **({"checkpoint": bench_checkpoint(args)} if args.checkpoint else {}),
    }


def _gpt_and_batches(args: argparse.Namespace, mesh) -> tuple[Any, list[dict[str, Any]]]:
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
        n_heads=args.heads, n_layers=args.layers, dtype=jnp.float32,
    )  # fmt: skip
    stream = data.batches(
        data.load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed
    )
    tokens = lambda: {"tokens": next(stream)["tokens"] % args.vocab}
    return cfg, [tokens() for _ in range(args.warmup + args.steps)]


def bench_matrix_optimizers(args: argparse.Namespace) -> dict[str, Any]:
    """``--matrices``: Muon's rows beside AdamW's (:mod:`benchmark.matrices`)."""
    mesh = jzero.data_mesh()
    cfg, batches = _gpt_and_batches(args, mesh)
    name = f"gpt-L{cfg.n_layers}-d{cfg.d_model}-h{cfg.n_heads}-T{cfg.seq_len}-V{cfg.vocab_size}"
    return {
        "platform": jax.devices()[0].platform,
        "devices": mesh.shape["data"],
        "jax": jax.__version__,
        "model": {"name": name, "layers": cfg.n_layers, "dtype": "float32"},
        "settings": {"batch": args.batch, "warmup": args.warmup, "steps": args.steps},
        "optimizers": {"adamw": "optax.adamw(1e-3)", "muon": "gpt.muon(lr 0.02, adam 1e-3)"},
        "matrices": bench_matrices(cfg, mesh, batches, args.warmup),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = bench(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if "runs" in result:
        print(table(result, quick=args.quick))
    if "checkpoint" in result:
        print(("\n" if "runs" in result else "") + checkpoint_table(result["checkpoint"]))
    if "matrices" in result:
        print(matrices_table(result["matrices"]))
    if "max_model" in result:
        print(max_model.max_model_table(result["max_model"], platform=result["platform"]))
    return result


if __name__ == "__main__":
    # A script may configure JAX (the library never does). This only shapes the CPU
    # platform, so it is harmless when an accelerator is present and used instead.
    cli = parse_args(sys.argv[1:])
    jax.config.update("jax_num_cpu_devices", cli.cpu_devices)
    main()
