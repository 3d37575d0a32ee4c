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
the byte. So the real GPU compiles a third time, autotuning off (``device_untuned``), with
its own target: the compile-only devices predict the program to the byte, and the 1 %
target states what autotuning adds at this size (a fixed 32 MiB, not a share).

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
import sys
import time
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
        _progress(f"stage {stage}: compiling on {len(devices)} x {kind}", start)
        entry = {"device": memory(devices, s, stage),
                 "device_untuned": memory(devices, s, stage, UNTUNED)}  # fmt: skip
        if failed is not None:  # an earlier stage's compile failed: not tried again
            entry["deviceless_error"] = failed
        elif targetless is not None:
            _progress(f"stage {stage}: compiling on {len(targetless)} compile-only {name}", start)
            try:
                entry["deviceless"] = memory(targetless, s, stage)
            except Exception as e:  # e.g. no ptxas for a compile without a device
                entry["deviceless_error"] = failed = first_line(e)
        if "deviceless" in entry:
            for real, key in (("device", "rel_diff"), ("device_untuned", "rel_diff_untuned")):
                entry[key] = {f: rel_diff(entry[real][f], entry["deviceless"][f]) for f in FIGURES}
        stages[f"zero{stage}"] = entry
        targets += [
            _target(ctx, stage, entry, why, key) for key in ("rel_diff", "rel_diff_untuned")
        ]
    _progress("compiled", start)
    return {
        "sizes": s, "devices": len(devices), "device_kind": kind, "compile_only_gpu": name,
        "compile_only_kind": targetless[0].device_kind if targetless else None,
        "stages": stages, "targets": targets,
    }  # fmt: skip


def _target(
    ctx: Context, stage: int, entry: dict[str, Any], why: str | None, key: str
) -> dict[str, Any]:
    """Stage ``stage``'s target against the real compile (``key`` ``rel_diff``) or the real
    compile without autotuning (``rel_diff_untuned``): the worst of its figures' relative
    differences <= 1 % (skipped, with the reason, when there was nothing to compare or
    under ``--dry-run``)."""
    untuned = key == "rel_diff_untuned"
    name = f"agreement zero{stage} memory" + (", autotuning off" if untuned else "")
    if why is not None:  # no compile-only GPUs here, dry run or not
        return skip(name, why)
    if "deviceless" not in entry:
        return skip(name, f"skipped: the compile for compile-only GPUs failed here "
                          f"({entry['deviceless_error']})")  # fmt: skip
    if ctx.dry_run:
        return skip(name, DRY_SKIP)
    worst = max(FIGURES, key=lambda f: entry[key][f])
    measured = float(entry[key][worst])
    diffs = ", ".join(f"{f} {entry[key][f]:.2%}" for f in FIGURES)
    real = "real compile's (autotuning off)" if untuned else "real compile's"
    text = (f"zero{stage}: compile agreement within 1%: deviceless vs {real} "
            f"memory ({diffs}), worst {measured:.2%} <= {AGREEMENT:.0%}")  # fmt: skip
    return target(name, measured <= AGREEMENT, text, measured=measured, bound=AGREEMENT)
