"""The example GPT's step compiled by XLA's GPU compiler for GPUs that are not here
(``jzero.gpu_mesh``): jzero's step at stages 0-3 (and stage 3 with prefetch), the user's
own ``jax.jit`` step with ``jzero.shard_optimizer`` at stages 1-3, and plain data-parallel
``jax.jit``, on 8 H200s (and 64 over 8 hosts). What each compile shows, per device: its
temporaries and inputs (XLA's buffer assignment), the elements it sends (ring model, by
trip count), the collectives inside the loops, and which all-gathers overlap compute.

tests/core/gpu_target/test_compiled_for_gpus.py asserts on these programs (P23's
section 2); this script records their figures:

    JAX_PLATFORMS=cpu python scripts/gpu_compile.py --out benchmarks/gpu_compile_h200.json

The model: examples/gpt.py, 4 scanned, rematerialised blocks, d_model 512, bf16 compute,
fp32 parameters, AdamW; 64 sequences of 128 tokens. A compile is a fact about the GPU
program; its time here is this machine's (2 cores), not the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPUs are compile-only (jzero.gpu_mesh)

import gpt  # noqa: E402  examples/gpt.py
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jzero  # noqa: E402
from jzero.accounting.hlo import collectives  # noqa: E402
from jzero.accounting.schedule import collective_overlap  # noqa: E402
from jzero.optimizers.user_step.placement import resting_specs  # noqa: E402

L = 4
CFG = gpt.GPTConfig(seq_len=128, d_model=512, n_heads=8, n_layers=L, dtype=jnp.bfloat16)
SEQUENCES = 64
LOSS = gpt.make_loss_fn(CFG)


def init():
    """The GPT's parameters (traceable: ``jax.eval_shape`` gives their shapes)."""
    return gpt.init_params(CFG, jax.random.key(0))


PARAMS = jax.eval_shape(init)
PSI = sum(x.size for x in jax.tree.leaves(PARAMS))  # parameters
STACK = jax.tree.leaves(PARAMS["blocks"])  # the scanned layers' leaves, [L, ...]
LAYER_MATRICES = frozenset(x.shape[1:] for x in STACK if x.ndim >= 3)  # a layer's weights


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step's figures."""

    seconds: float  # tracing, lowering and compiling here
    temp: int  # buffer assignment: temporaries, bytes per device
    argument: int  # the step's inputs (state and batch), bytes per device
    found: tuple  # its collectives (jzero.accounting.hlo.Collective)
    overlaps: tuple  # each collective and the compute scheduled under it
    carried: tuple  # (dtype, shape) of each array a while loop carries from step to step

    def elements(self, kind: str | None = None) -> float:
        """Elements each device sends per step in the ring model, by trip count."""
        return sum(
            c.ring_bytes * c.trip_count / jnp.dtype(_DTYPES[c.dtype]).itemsize
            for c in self.found
            if kind is None or c.kind == kind
        )

    def in_loops(self, kind: str) -> list:
        return [c for c in self.found if c.kind == kind and (c.trip_count or 1) >= L - 1]


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32"}
_DTYPES |= {"u32": "uint32", "pred": "bool", "s8": "int8", "u8": "uint8"}


@functools.cache
def _mesh(devices: int) -> Any:
    return jzero.gpu_mesh("h200", devices=devices, hosts=max(1, devices // 8))


def batch(mesh) -> dict:
    """The global batch's shape, split over 'data'."""
    tokens = (SEQUENCES, CFG.seq_len + 1)
    return {
        "tokens": jax.ShapeDtypeStruct(tokens, jnp.int32, sharding=NamedSharding(mesh, P("data")))
    }


_COMPILED: dict[tuple, Any] = {}  # (lowered text's hash, devices, jit options): compiled


def _compile(lowered, devices: int, options: tuple = ()) -> Any:
    """XLA's GPU compile of ``lowered``, once per program: two steps that lower to the same
    text (the user's at stages 1 and 2, whose state keeps one layout) share it. ``options``
    holds what jit gives XLA beside the text (``pipeline_scatter``'s compiler options)."""
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), devices, options)
    if key not in _COMPILED:
        _COMPILED[key] = lowered.compile()
    return _COMPILED[key]


def _figures(lower, start: float, devices: int, options: tuple = ()) -> Program:
    compiled = _compile(lower(), devices, options)
    seconds = time.perf_counter() - start
    memory, text = compiled.memory_analysis(), compiled.as_text()
    overlaps = tuple(collective_overlap(text))
    return Program(seconds, memory.temp_size_in_bytes, memory.argument_size_in_bytes,
                   tuple(collectives(text)), overlaps, loop_carried(text))  # fmt: skip


def loop_carried(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The arrays the while loops of a compiled module's text carry: their state tuples'
    ``(dtype, shape)``, one entry per array per loop."""
    loops = [line for line in text.splitlines() if " while(" in line]
    states = [line.split(" while(")[0].split(" = ", 1)[-1] for line in loops]
    return tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for state in states
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", state)
    )


def layer_arrays_carried(program: Program) -> int:
    """How many arrays of a layer's weight-matrix shape (a stacked leaf without its layer
    axis) the loops carry: backward's full gradients where a reduce-scatter is pipelined
    into the next step, the next layer's gathered weights where gathers are prefetched."""
    return sum(shape in LAYER_MATRICES for _, shape in program.carried)


def activation_stacks(program: Program, devices: int = 8) -> int:
    """How many stacks of every layer's input activation (one bf16 ``[B/N, T, D]`` per
    layer) the loops carry: forward's saved stack, and backward's."""
    stack = (L, SEQUENCES // devices, CFG.seq_len, CFG.d_model)
    return sum(carried == ("bf16", stack) for carried in program.carried)


def jzero_step(
    stage: int, devices: int = 8, prefetch: bool = False, pipeline_scatter: bool = False
) -> Program:
    """jzero's own step (default gathering: ``manual_gather=False``)."""
    return _jzero_step(stage, devices, prefetch, pipeline_scatter)  # one cache key per step


@functools.cache
def _jzero_step(stage: int, devices: int, prefetch: bool, pipeline_scatter: bool) -> Program:
    start = time.perf_counter()
    step, state, inputs = jzero_inputs(stage, devices, prefetch, pipeline_scatter)
    lower = lambda: step.lower(state, inputs)
    return _figures(lower, start, devices, ("pipeline_scatter",) * pipeline_scatter)


@functools.cache
def jzero_inputs(
    stage: int, devices: int = 8, prefetch: bool = False, pipeline_scatter: bool = False
) -> tuple[Any, Any, dict]:
    """jzero's train step, its abstract state and batch. Lowered and compiled again (e.g. by
    ``jzero.report``), the step is compiled again: JAX's compile cache does not serve a
    new lowering for compile-only GPUs (tests/durations.md lists such repeats)."""
    mesh = _mesh(devices)
    comm = jzero.Communication(prefetch=prefetch, pipeline_scatter=pipeline_scatter)
    opt = jzero.ZeroOptimizer(optax.adamw(1e-3), mesh, stage=stage, comm=comm)
    state = jax.eval_shape(*opt.init_program(init_fn=init))
    return opt.train_step(LOSS), state, batch(mesh)


def _jit_step(tx, loss_fn, params, mesh) -> Program:
    """The step a user writes: value_and_grad, tx.update, apply_updates, donated."""
    start = time.perf_counter()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(tx.init, params)
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    out = (*shardings, NamedSharding(mesh, P()))
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=out)
    lower = lambda: jitted.trace(params, opt_state, batch(mesh)).lower()
    return _figures(lower, start, mesh.size)


def _abstract(specs: Any, mesh) -> Any:
    at = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
    return jax.tree.map(at, PARAMS, specs)


def user_step(stage: int, devices: int = 8) -> Program:
    """The user's own jit step with ``jzero.shard_optimizer`` (stage 3: parameters placed
    by ``jzero.shard_params``' layout and gathered by the model's ``jzero.gather(mesh=)``)."""
    return _user_step(stage, devices)  # one cache key per step


@functools.cache
def _user_step(stage: int, devices: int) -> Program:
    mesh = _mesh(devices)
    tx = jzero.shard_optimizer(optax.adamw(1e-3), mesh, stage=stage)
    if stage == 3:
        specs = resting_specs(PARAMS, mesh, None)
        loss_fn = gpt.make_loss_fn(dataclasses.replace(CFG, gather_mesh=mesh))
    else:
        specs, loss_fn = jax.tree.map(lambda _: P(), PARAMS), LOSS
    return _jit_step(tx, loss_fn, _abstract(specs, mesh), mesh)


@functools.cache
def plain_step() -> Program:
    """Plain data parallel: Optax's AdamW in a donated jit step, parameters replicated."""
    mesh = _mesh(8)
    return _jit_step(
        optax.adamw(1e-3), LOSS, _abstract(jax.tree.map(lambda _: P(), PARAMS), mesh), mesh
    )


def record(program: Program, stage: int, devices: int) -> dict[str, Any]:
    """One program's figures, as the JSON holds them."""
    theory = (3 if stage == 3 else 2) * PSI * (devices - 1) / devices
    reduced = [c for c in program.found if c.kind == "all-reduce"]
    looped = [o for o in program.overlaps if o.kind == "all-gather" and (o.trip_count or 1) > 1]
    return {
        "temp_bytes": program.temp,
        "argument_bytes": program.argument,
        "elements_sent": program.elements(),
        "elements_over_theory": program.elements() / theory,
        "all_reduced_elements": sum(math.prod(c.shape) * c.trip_count for c in reduced),
        "largest_all_reduce": max((math.prod(c.shape) for c in reduced), default=0),
        "in_loop_all_gathers": len(looped),
        "in_loop_all_gathers_overlapped": sum(o.asynchronous and o.overlaps for o in looped),
        "loop_carried_layer_arrays": layer_arrays_carried(program),
        "compile_s": round(program.seconds, 1),
    }


PROGRAMS = {  # name -> (builder, stage, devices)
    "plain_jit": (plain_step, 0, 8),
    **{f"zero{s}": (functools.partial(jzero_step, s), s, 8) for s in range(4)},
    "zero3_prefetch": (functools.partial(jzero_step, 3, prefetch=True), 3, 8),
    "zero3_pipelined": (functools.partial(jzero_step, 3, pipeline_scatter=True), 3, 8),
    **{f"user{s}": (functools.partial(user_step, s), s, 8) for s in (1, 2, 3)},
    **{f"zero{s}_64": (functools.partial(jzero_step, s, 64), s, 64) for s in (1, 2, 3)},
    **{f"user{s}_64": (functools.partial(user_step, s, 64), s, 64) for s in (1, 2)},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--only", help="comma-separated subset of " + ",".join(PROGRAMS))
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(PROGRAMS)
    start, runs = time.perf_counter(), {}
    for name in names:
        build, stage, devices = PROGRAMS[name]
        runs[name] = record(build(), stage, devices)
        print(f"{name:16s} {json.dumps(runs[name])}", file=sys.stderr, flush=True)
    stack_grad = 4 * sum(x.size for x in STACK)
    result = {
        "gpu": "h200", "model": dataclasses.asdict(CFG) | {"dtype": "bfloat16"},
        "sequences": SEQUENCES, "parameters": PSI, "stack_grad_bytes_fp32": stack_grad,
        "jax": jax.__version__, "cores": os.cpu_count(), "runs": runs,
        "total_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
