"""The benchmark's matrix-optimizer rows: Muon against AdamW on the example GPT.

For the GPT scanned (``nn.scan``: the blocks' kernels carry a layer axis, Muon's batch
dimension) and unrolled (``GPTConfig.unrolled``: 2-D kernels, updated in stacks of one
shape), at stages 1-3, in jzero's step and in the user's own step
(``jzero.shard_optimizer``), with ``optax.adamw`` and with ``gpt.muon`` (Newton-Schulz on
the blocks' kernels, AdamW on the rest), on the same batches: collective bytes per step
(ring model), matmul FLOPs per device (``dot_flops`` of the compiled step), the compiled
peak, the median step time, and Muon's ratios to AdamW. ``newton_schulz_flops_per_device``
is Muon's FLOPs less AdamW's; ``newton_schulz_share`` divides it by 1/N of one device's
``muon.update`` FLOPs (1.0: each device orthogonalizes exactly its share).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

import gpt  # examples/gpt.py (bench.py puts examples/ on the path)
import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import comm_bytes
from jzero.accounting.hlo import dot_flops

from .runs import _timed


def _zero_step(tx, mesh, stage, init_fn, loss_fn):
    opt = jzero.ZeroOptimizer(tx, mesh, stage=stage)
    step = opt.train_step(loss_fn, manual_gather=True)
    return step, opt.init(init_fn=init_fn)


def _user_step(tx, mesh, stage, init_fn, loss_fn):
    sharded = jzero.shard_optimizer(tx, mesh, stage=stage)
    params = jax.jit(init_fn, out_shardings=NamedSharding(mesh, P()))()
    params = jzero.shard_params(params, mesh, stage=stage)

    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = sharded.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    return jax.jit(step, donate_argnums=0), (params, sharded.init(params))


def _measure(step, carry, batches, warmup: int) -> dict[str, Any]:
    compiled = step.lower(carry, batches[0]).compile()
    text, memory = compiled.as_text(), compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes
    peak += memory.temp_size_in_bytes - memory.alias_size_in_bytes
    _, losses, times = _timed(step, carry, batches, warmup)
    return {
        "comm_bytes_per_device": comm_bytes(text)["total"],
        "dot_flops_per_device": dot_flops(text),
        "peak_bytes_per_device": peak,
        "step_ms_median": statistics.median(times),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def _newton_schulz_flops(tx, init_fn) -> int:
    """One device's matmul FLOPs of ``tx.update`` on the whole model (AdamW's: none)."""
    params = jax.eval_shape(init_fn)
    state = jax.eval_shape(tx.init, params)
    return dot_flops(jax.jit(tx.update).lower(params, state, params).compile().as_text())


def bench_matrices(cfg, mesh, batches, warmup: int) -> list[dict[str, Any]]:
    """Muon's and AdamW's rows for ``cfg``'s GPT, scanned and unrolled, stages 1-3."""
    rows, n = [], mesh.shape["data"]
    user_batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
    for unrolled in (False, True):
        model = dataclasses.replace(cfg, unrolled=unrolled)
        init_fn = functools.partial(gpt.init_params, model, jax.random.key(0))
        muon = gpt.muon(jax.eval_shape(init_fn), 0.02, adam_learning_rate=1e-3)
        share = _newton_schulz_flops(muon, init_fn) / n
        user_loss = gpt.make_loss_fn(dataclasses.replace(model, gather_mesh=mesh))
        for api, make, loss_fn, data in (
            ("zero", _zero_step, gpt.make_loss_fn(model), batches),
            ("user", _user_step, user_loss, user_batches),
        ):
            for stage in (1, 2, 3):
                both = {}
                for name, tx in (("adamw", optax.adamw(1e-3)), ("muon", muon)):
                    step, carry = make(tx, mesh, stage, init_fn, loss_fn)
                    both[name] = _measure(step, carry, data, warmup)
                rows.append(_row(unrolled, api, stage, both, share))
    return rows


def _row(unrolled: bool, api: str, stage: int, both: dict, share: float) -> dict[str, Any]:
    adamw, muon = both["adamw"], both["muon"]
    ns = muon["dot_flops_per_device"] - adamw["dot_flops_per_device"]
    ratio = lambda key: muon[key] / adamw[key]
    return {
        "model": "unrolled" if unrolled else "scanned",
        "api": api,
        "stage": stage,
        "adamw": adamw,
        "muon": muon,
        "comm_ratio": ratio("comm_bytes_per_device"),
        "peak_ratio": ratio("peak_bytes_per_device"),
        "step_time_ratio": ratio("step_ms_median"),
        "newton_schulz_flops_per_device": ns,
        "newton_schulz_share": ns / share,
    }


def matrices_table(rows: list[dict[str, Any]]) -> str:
    """Muon over AdamW per row: bytes, peak, step time; its Newton-Schulz share."""
    head = ("model", "api", "stage", "comm x", "peak x", "time x", "NS share", "muon ms")
    lines = ["  ".join(f"{h:>9}" for h in head)]
    for r in rows:
        cells = (
            r["model"], r["api"], r["stage"], f"{r['comm_ratio']:.3f}", f"{r['peak_ratio']:.3f}",
            f"{r['step_time_ratio']:.2f}", f"{r['newton_schulz_share']:.3f}",
            f"{r['muon']['step_ms_median']:.1f}",
        )  # fmt: skip
        lines.append("  ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)
