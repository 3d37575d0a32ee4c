"""The benchmark's runs: each stage and variant as a :class:`Run`, trained on the same
batches and measured (model-state bytes, the compiled peak, communication, collectives,
step time) by :func:`run_zero` (jzero's step), :func:`run_auto_fsdp` (plain ``jit``) or
:func:`run_user_step` (the user's own ``jit`` step with ``jzero.shard_optimizer``)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero import report
from jzero.accounting import (
    Collective,
    collectives,
    comm_bytes,
    launches,
    theory_comm_bytes,
    theory_model_state_bytes,
)
from jzero.accounting.memory_spaces import of_compiled


class Run(NamedTuple):
    """One training run of the benchmark."""

    name: str
    stage: int  # the ZeRO stage (auto_fsdp: 3, the stage it is compared with)
    step_options: dict[str, bool] | None  # jzero train_step keywords; None: a plain-jit step
    opt_options: dict[str, Any] = {}  # ZeroOptimizer keywords beyond tx, mesh, stage
    user_step: bool = False  # the user's own jit step with jzero.shard_optimizer


def _comm(**fields: Any) -> dict[str, jzero.Communication]:
    return {"comm": jzero.Communication(**fields)}


MANUAL = {"manual_gather": True}
HPZ_GROUP = 4  # zero3_hpz: backward's all-gathers within groups of 4 of the 8 devices
AUTO = {"manual_gather": False}
RUNS = (
    Run("dp", 0, MANUAL),
    Run("zero1", 1, MANUAL),
    Run("zero2", 2, MANUAL),
    Run("zero3", 3, MANUAL),
    Run("zero3_bucket", 3, MANUAL, _comm(bucket=True)),
    Run("zero3_auto", 3, AUTO),
    Run("zero3_prefetch", 3, AUTO, _comm(prefetch=True)),
    Run("zero3_int8", 3, MANUAL, _comm(gather_quant="int8")),
    Run("zero3_fp8", 3, MANUAL, _comm(gather_quant="fp8")),
    Run("zero3_hpz", 3, AUTO, _comm(hpz=HPZ_GROUP)),
    Run("zero3_qgz", 3, MANUAL, _comm(grad_quant="int8")),
    Run("zero3_offload", 3, MANUAL, {"offload": "optimizer"}),
    Run("auto_fsdp", 3, None),
    Run("user_zero1", 1, None, user_step=True),
    Run("user_zero2", 2, None, user_step=True),
    Run("user_zero3", 3, None, user_step=True),
)
USER_BASES = {"user_zero1": "zero1", "user_zero2": "zero2", "user_zero3": "zero3"}
COMM_KEYS = ("all-reduce", "reduce-scatter", "all-gather", "other", "total")
ADAMW = "adamw(1e-3, eps=1e-6, wd=0.01)"


def adamw() -> optax.GradientTransformation:
    return optax.adamw(1e-3, eps=1e-6, weight_decay=0.01)


def _bytes_per_device(tree: Any) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _total_bytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """'data' on the largest dimension divisible by n (later on ties); else replicated."""
    even = [d for d, s in enumerate(shape) if s % n == 0 and s > 0]
    if not even:
        return P()
    dim = max(even, key=lambda d: (shape[d], d))
    return P(*([None] * dim + ["data"]))


def _timed(step, carry, batches, warmup: int) -> tuple[Any, list[float], list[float]]:
    """Runs every batch; returns the last carry, the losses and the timed steps' ms."""
    losses, times = [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        carry, metrics = step(carry, batch)
        jax.block_until_ready((carry, metrics))
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
        losses.append(float(metrics["loss"]))
    return carry, losses, times


def _json_options(run: Run) -> dict[str, Any]:
    """The run's train_step and ZeroOptimizer keywords, JSON-able (:func:`json_options`)."""
    return json_options(run.step_options or {}, run.opt_options)


def json_options(
    step_options: dict[str, Any], opt_options: dict[str, Any], *, block: bool = True
) -> dict[str, Any]:
    """train_step and ZeroOptimizer keywords, JSON-able: a ``Precision`` or
    ``Communication`` as its fields that differ from the default (with ``block``, also
    ``quant_block`` when it quantizes)."""
    out: dict[str, Any] = dict(step_options)
    for key, value in opt_options.items():
        if dataclasses.is_dataclass(value):
            default = type(value)()
            quantizes = getattr(value, "gather_quant", None) or getattr(value, "grad_quant", None)
            diff = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(default, f.name)
                or (f.name == "quant_block" and quantizes and block)
            }
            value = {k: v.name if isinstance(v, np.dtype) else v for k, v in diff.items()}
        out[key] = value
    return out


def _bytes_by_group(colls: list[Collective], kind: str) -> dict[str, float]:
    """Ring-model bytes per step of one kind of collective by replica-group size (hpZ: the
    groups' size within, the number of groups across)."""
    out: dict[str, float] = {}
    for c in colls:
        if c.kind == kind:
            key = str(c.group_size)
            out[key] = out.get(key, 0.0) + c.ring_bytes * c.trip_count
    return out


def _bytes_by_dtype(colls: list[Collective], kind: str) -> dict[str, float]:
    """Ring-model bytes per step of one kind of collective by HLO element type (``s8``,
    ``u8``: quantized; ``f32`` beside them: their scales)."""
    out: dict[str, float] = {}
    for c in colls:
        if c.kind == kind:
            out[c.dtype] = out.get(c.dtype, 0.0) + c.ring_bytes * c.trip_count
    return out


def _run_fields(run: Run, losses, times, **fields) -> dict[str, Any]:
    comm = {k: float(fields["comm"][k]) for k in COMM_KEYS}
    return {
        "name": run.name,
        "stage": run.stage,
        "options": _json_options(run),
        "model_state_bytes_per_device": int(fields["states"]),
        "theory_model_state_bytes_per_device": float(fields["theory_states"]),
        "peak_bytes_per_device": int(fields["peak"]),
        "device_peak_bytes_per_device": int(fields["spaces"]["device"]),
        "host_peak_bytes_per_device": int(fields["spaces"]["pinned_host"]),
        "host_bytes_per_device": int(fields["host"]),
        "comm_bytes_per_device": comm,
        "all_gather_bytes_by_dtype": _bytes_by_dtype(fields["collectives"], "all-gather"),
        "all_to_all_bytes_by_dtype": _bytes_by_dtype(fields["collectives"], "all-to-all"),
        "all_gather_bytes_by_group_size": _bytes_by_group(fields["collectives"], "all-gather"),
        "theory_comm_bytes_per_device": float(fields["theory_comm"]),
        "collectives_per_step": launches(fields["collectives"]),
        "step_ms_median": float(statistics.median(times)),
        "steps_timed": len(times),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def run_zero(run: Run, tx, mesh, init_fn, loss_fn, batches, warmup) -> dict[str, Any]:
    opt = jzero.ZeroOptimizer(tx, mesh, stage=run.stage, **run.opt_options)
    state = opt.init(init_fn=init_fn)
    step = opt.train_step(loss_fn, **run.step_options)
    rep = report(step, state, batches[0])
    host = sum(b for kind, b in rep.bytes_by_memory_kind.items() if kind != "device")
    _, losses, times = _timed(step, state, batches, warmup)
    return _run_fields(
        run, losses, times, host=host,
        states=rep.model_state_bytes, theory_states=rep.theory_model_state_bytes,
        peak=rep.peak_bytes, spaces=rep.peak_bytes_by_space, comm=rep.comm_bytes,
        theory_comm=rep.theory_comm_bytes, collectives=list(rep.collectives),
    )  # fmt: skip


def run_auto_fsdp(run: Run, tx, mesh, init_fn, loss_fn, batches, warmup) -> dict[str, Any]:
    n = mesh.shape["data"]
    shard = lambda tree: jax.tree.map(lambda x: NamedSharding(mesh, _fsdp_spec(x.shape, n)), tree)
    param_shardings = shard(jax.eval_shape(init_fn))
    params = jax.jit(init_fn, out_shardings=param_shardings)()
    opt_shardings = shard(jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    shardings = (param_shardings, opt_shardings)
    grads = _bytes_per_device(params)  # a shard like its parameter
    return _run_jit_step(run, tx, (params, opt_state), shardings, grads, loss_fn, batches, warmup)


def run_user_step(run: Run, tx, mesh, init_fn, loss_fn, batches, warmup) -> dict[str, Any]:
    """The step a user writes with Optax, ``jzero.shard_optimizer`` in ``tx``'s place
    (``jzero.shard_params`` first at stage 3); the compiler chooses the outputs' layout."""
    sharded = jzero.shard_optimizer(tx, mesh, stage=run.stage)
    params = jax.jit(init_fn, out_shardings=NamedSharding(mesh, P()))()
    if run.stage == 3:
        params = jzero.shard_params(params, mesh)
    opt_state = sharded.init(params)
    # Gradients: whole at stage 1, a shard like the stage-3 layout's at stages 2-3.
    grads = _bytes_per_device(jzero.shard_params(params, mesh) if run.stage >= 2 else params)
    carry = (params, opt_state)
    return _run_jit_step(run, sharded, carry, None, grads, loss_fn, batches, warmup)


def _run_jit_step(run: Run, tx, carry, shardings, grads, loss_fn, batches, warmup) -> dict:
    """One plain ``jax.jit`` step of ``value_and_grad``, ``tx.update`` and
    ``apply_updates`` over ``carry = (params, opt_state)``, donated; ``shardings``: its
    in/out shardings (None: the compiler's choice); ``grads``: gradient bytes per device."""
    params, opt_state = carry
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    batch_sharding = jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batches[0])

    def train_step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    if shardings is None:
        step = jax.jit(train_step, donate_argnums=0)
    else:
        step = jax.jit(
            train_step,
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )
    compiled = step.lower(carry, batches[0]).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    peak -= mem.alias_size_in_bytes
    psi = sum(x.size for x in jax.tree.leaves(params))
    param_total, opt_total = _total_bytes(params), _total_bytes(opt_state)
    states = _bytes_per_device(params) + grads + _bytes_per_device(opt_state)
    theory_states = theory_model_state_bytes(
        params=psi, devices=mesh.shape["data"], stage=run.stage, param_bytes=param_total / psi,
        grad_bytes=param_total / psi, opt_bytes=opt_total / psi,
    )  # fmt: skip
    text = compiled.as_text()
    colls = collectives(text)
    theory_comm = theory_comm_bytes(
        stage=run.stage, param_bytes_S=param_total, devices=mesh.shape["data"]
    )
    _, losses, times = _timed(step, carry, batches, warmup)
    return _run_fields(
        run, losses, times, host=0, states=states, theory_states=theory_states, peak=peak,
        spaces=of_compiled(compiled, text), comm=comm_bytes(colls), theory_comm=theory_comm,
        collectives=colls,
    )  # fmt: skip
