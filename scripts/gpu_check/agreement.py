"""The GPU check's ``agreement`` piece: does the deviceless compile's memory
(``jzero.gpu_mesh``'s compile-only GPUs, what CI asserts on) agree with the real GPU's?

The example GPT's jzero step (the model of ``scripts/gpu_compile.py``: 4 scanned,
rematerialised blocks, d_model 512, bf16 compute, fp32 parameters, AdamW; 64 sequences
of 128 tokens) is compiled at stages 0-3 twice, from abstract states (nothing runs):

- on the devices present (the lent GPU: N = 1), through the real backend;
- on N compile-only GPUs of the same kind, described from the spec jzero ships for it
  (``jzero/core/gpu_target/specs/``), through ``jax.experimental.topologies``.

and each compile's ``memory_analysis()`` is read: temporaries, arguments and outputs per
device. Target per stage: each of the three within :data:`AGREEMENT` (1 %) of the real
compile's.

The real compile autotunes its kernels on the GPU; the compile-only one cannot. On the
H200 (2026-12-01) the two agreed to the byte in arguments and outputs, and the real temp
was 7.96 % above (340.9 against 313.8 MB at every stage): cuBLAS workspaces
(``s8[33554432]``, 32 MiB) that the autotuned gemms take. Compiled on the GPU with
autotuning off (``xla_gpu_autotune_level=0``), the temp was the deviceless compile's to
the byte (``benchmarks/h200_compile_probes.md``). So each stage is compiled four ways:

- on the GPU (``device``), its autotuning results written to a file;
- on the GPU with autotuning off (``device_untuned``);
- for the compile-only GPUs (``deviceless``);
- for them with the GPU's autotuning results loaded (``deviceless_tuned``; XLA's
  ``xla_gpu_load_autotune_results_from``, which the deviceless compile honours), and the
  results kept in the JSON (``autotune_results``): with them, a compile without a GPU can
  make the GPU's kernel choices.

Three targets per stage, each 1 %: deviceless against the GPU's compile, against it with
autotuning off, and deviceless with the GPU's autotuning against the GPU's compile.

The compile-only devices are described here directly (``get_topology_desc(name, "cuda",
target_config=SPEC, topology="1x1xN")``), not through ``jzero.gpu_mesh``: that refuses
when JAX does not run on the CPU and wants the CUDA 12 plugin, while the lent GPU runs
JAX on CUDA (its CUDA 13 plugin). If the topology cannot be described or compiled for
there, the targets are skipped with the reason, beside the real compile's figures.

``--dry-run``: the same code on one CPU device at a tiny size, stages 0 and 3 (the
compile-only H200 against the CPU); the targets are skipped, CPU memory is not GPU
memory.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpt  # examples/gpt.py
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero

from .common import Context, skip, target

AGREEMENT = 0.01
"""Each memory figure of the deviceless compile within 1 % of the real GPU's."""

STAGES = {"gpu": (0, 1, 2, 3), "dry": (0, 3)}  # the dry run: the code path, in CI's time
FIGURES = ("temp", "argument", "output")  # memory_analysis()'s *_size_in_bytes compared
UNTUNED = {"xla_gpu_autotune_level": 0}  # the real compile without autotuning
DUMP_TUNING = "xla_gpu_dump_autotune_results_to"  # the real compile's kernel choices, saved
LOAD_TUNING = "xla_gpu_load_autotune_results_from"  # and given to the compile-only GPUs
COMPARED = {  # targets: the real compile -> the compile-only GPUs' it is held to
    "rel_diff": ("device", "deviceless"),
    "rel_diff_untuned": ("device_untuned", "deviceless"),
    "rel_diff_tuned": ("device", "deviceless_tuned"),
}
SIZES = {  # "gpu": scripts/gpu_compile.py's model (tests/project/test_gpu_check.py checks)
    "gpu": {"d_model": 512, "heads": 8, "seq_len": 128, "vocab": 256, "layers": 4,
            "sequences": 64},
    "dry": {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "layers": 2,
            "sequences": 8},
}  # fmt: skip
KINDS = (  # (text in the real device_kind, jzero's spec): the GPUs the check is lent
    ("H200", "h200"),  # "NVIDIA H200"
    ("H100 80GB HBM3", "h100"),  # H100 SXM; not the PCIe or NVL cards (other specs)
)
DRY_GPU = "h200"  # the compile-only GPU the dry run compiles for
DRY_SKIP = "skipped: dry run: CPU memory is not GPU memory (the code path, at a tiny size)"


def config(s: dict[str, int]) -> gpt.GPTConfig:
    """The GPT at ``s``, computing in bf16 (as ``scripts/gpu_compile.py``'s ``CFG``)."""
    return gpt.GPTConfig(
        vocab_size=s["vocab"], seq_len=s["seq_len"], d_model=s["d_model"],
        n_heads=s["heads"], n_layers=s["layers"], dtype=jnp.bfloat16,
    )  # fmt: skip


def spec_name(device_kind: str) -> str | None:
    """jzero's spec for a real GPU's ``device_kind`` (None: none matches)."""
    return next((name for text, name in KINDS if text in device_kind), None)


def compile_only_devices(name: str, count: int) -> tuple[list[Any] | None, str | None]:
    """``count`` compile-only GPUs described from jzero's spec ``name`` on one host, as
    ``(devices, None)``, or ``(None, why not)``."""
    from jzero.core.gpu_target.topology import SPECS  # the spec files jzero ships

    spec = importlib.resources.files("jzero.core.gpu_target").joinpath("specs", SPECS[name])
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(
            name, "cuda", target_config=spec.read_text(), topology=f"1x1x{count}"
        )
        return list(desc.devices), None
    except Exception as e:  # NotImplementedError: no CUDA plugin registered its topology
        return None, first_line(e)


def first_line(e: BaseException) -> str:
    """``Type: the message's first line`` (at most 300 characters of it)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def memory(
    devices: list[Any], s: dict[str, int], stage: int, options: dict | None = None
) -> dict[str, Any]:
    """The jzero step's ``memory_analysis()`` at ``stage`` over ``devices`` (compiled from
    abstract values, with XLA's ``options``) and the seconds the compile took."""
    start, cfg = time.perf_counter(), config(s)
    mesh = jzero.data_mesh(devices)
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=stage)
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(0))
    state = jax.eval_shape(*opt.init_program(init_fn=init_fn))
    tokens = jax.ShapeDtypeStruct((s["sequences"], cfg.seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P("data")))  # fmt: skip
    lowered = opt.train_step(gpt.make_loss_fn(cfg)).lower(state, {"tokens": tokens})
    compiled = lowered.compile(compiler_options=options)
    m = compiled.memory_analysis()
    found = {f: int(getattr(m, f"{f}_size_in_bytes")) for f in (*FIGURES, "alias")}
    return found | {"compile_s": round(time.perf_counter() - start, 2)}


def _stage(devices: list[Any], targetless: list[Any] | None, s: dict, stage: int) -> dict:
    """One stage's compiles: on the real devices (autotuning, its results written to a
    file) and without autotuning; for the compile-only ``targetless`` (None: not tried), as
    they are and with the real compile's autotuning results loaded (where it wrote any)."""
    with tempfile.TemporaryDirectory() as tmp:
        tuning = os.path.join(tmp, "autotune_results.textproto")
        entry = {"device": memory(devices, s, stage, {DUMP_TUNING: tuning}),
                 "device_untuned": memory(devices, s, stage, UNTUNED)}  # fmt: skip
        if targetless is None:
            return entry
        try:
            entry["deviceless"] = memory(targetless, s, stage)
        except Exception as e:  # e.g. no ptxas for a compile without a device
            return entry | {"deviceless_error": first_line(e)}
        if os.path.exists(tuning):  # a GPU's compile: its kernels' choices
            entry["autotune_results"] = Path(tuning).read_text()
            try:
                entry["deviceless_tuned"] = memory(targetless, s, stage, {LOAD_TUNING: tuning})
            except Exception as e:  # e.g. results keyed to another device description
                entry["deviceless_tuned_error"] = first_line(e)
    return entry


def rel_diff(device: int, deviceless: int) -> float:
    """``|deviceless - device| / device`` (0 when both are 0)."""
    return abs(deviceless - device) / device if device else float(deviceless != 0)


def _progress(what: str, start: float) -> None:
    """A line on stderr: where a part that runs out of time was (the driver reports it)."""
    print(f"{time.perf_counter() - start:7.1f} s  {what}", file=sys.stderr, flush=True)


def run(ctx: Context) -> dict[str, Any]:
    key = "dry" if ctx.dry_run else "gpu"
    s = SIZES[key]
    devices = jax.devices()
    kind = devices[0].device_kind
    name = DRY_GPU if ctx.dry_run else spec_name(kind)
    if name is None:
        targetless, why = None, f"skipped: jzero ships no spec matching the device kind {kind!r}"
    else:
        targetless, why = compile_only_devices(name, len(devices))
        if why is not None:
            why = (f"skipped: could not describe {len(devices)} compile-only {name} GPU(s) "
                   f"here ({why})")  # fmt: skip
    stages, targets, start, failed = {}, [], time.perf_counter(), None
    for stage in STAGES[key]:
        _progress(f"stage {stage}: compiling on {len(devices)} x {kind} and {name}", start)
        entry = _stage(devices, targetless if failed is None else None, s, stage)
        if failed is not None:  # an earlier stage's compile failed: not tried again
            entry["deviceless_error"] = failed
        failed = entry.get("deviceless_error")
        for diff, (real, less) in COMPARED.items():
            if real in entry and less in entry:
                entry[diff] = {f: rel_diff(entry[real][f], entry[less][f]) for f in FIGURES}
        stages[f"zero{stage}"] = entry
        targets += [_target(ctx, stage, entry, why, diff) for diff in COMPARED]
    _progress("compiled", start)
    return {
        "sizes": s, "devices": len(devices), "device_kind": kind, "compile_only_gpu": name,
        "compile_only_kind": targetless[0].device_kind if targetless else None,
        "stages": stages, "targets": targets,
    }  # fmt: skip


WHAT = {  # per target: its name's tail, and what the compile-only GPUs are held to
    "rel_diff": ("", "the real compile's"),
    "rel_diff_untuned": (", autotuning off", "the real compile's (autotuning off)"),
    "rel_diff_tuned": (", autotuning loaded", "the real compile's, its autotuning loaded"),
}


def _target(
    ctx: Context, stage: int, entry: dict[str, Any], why: str | None, key: str
) -> dict[str, Any]:
    """Stage ``stage``'s target ``key`` (:data:`COMPARED`): the worst of its figures'
    relative differences <= 1 % (skipped, with the reason, when there was nothing to
    compare or under ``--dry-run``)."""
    tail, held = WHAT[key]
    name = f"agreement zero{stage} memory{tail}"
    if why is not None:  # no compile-only GPUs here, dry run or not
        return skip(name, why)
    if "deviceless" not in entry:
        return skip(name, f"skipped: the compile for compile-only GPUs failed here "
                          f"({entry['deviceless_error']})")  # fmt: skip
    if ctx.dry_run:
        return skip(name, DRY_SKIP)
    if key not in entry:  # the real compile wrote no autotuning results, or they failed
        failed = entry.get("deviceless_tuned_error")
        why = f"its compile failed ({failed})" if failed else "the real compile wrote none"
        return skip(name, f"skipped: no autotuning results loaded: {why}")
    worst = max(FIGURES, key=lambda f: entry[key][f])
    measured = float(entry[key][worst])
    diffs = ", ".join(f"{f} {entry[key][f]:.2%}" for f in FIGURES)
    text = (f"zero{stage}: compile agreement within 1%: deviceless vs {held} "
            f"memory ({diffs}), worst {measured:.2%} <= {AGREEMENT:.0%}")  # fmt: skip
    return target(name, measured <= AGREEMENT, text, measured=measured, bound=AGREEMENT)
