"""Checkpoint throughput (``python scripts/bench.py --checkpoint-only``): a GPT of at
least ``--checkpoint-mb`` MB of model states, saved, restored into two layouts and
exported, each timed."""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
import time
from typing import Any

import gpt  # examples/gpt.py
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero import _table

from .runs import ADAMW, adamw

CKPT_OPS = ("save_blocking", "save_total", "restore_same", "restore_other", "export")


def checkpoint_config(mb: float, *, vocab: int = 256, seq_len: int = 64) -> gpt.GPTConfig:
    """The GPT whose params + Adam state (3 x 4 bytes per parameter) first reach ``mb`` MB:
    d_model the widest of 64-1024 with one layer's states <= mb / 4, then the fewest
    layers (at most 1,000)."""

    def cfg(d: int, layers: int) -> gpt.GPTConfig:
        return gpt.GPTConfig(
            vocab_size=vocab, seq_len=seq_len, d_model=d, n_heads=max(1, d // 64),
            n_layers=layers, dtype=jnp.float32,
        )  # fmt: skip

    def states(c: gpt.GPTConfig) -> int:
        init_fn = functools.partial(gpt.init_params, c, jax.random.key(0))
        return 12 * gpt.count_params(jax.eval_shape(init_fn))

    target = mb * 1e6
    per_layer = lambda d: states(cfg(d, 2)) - states(cfg(d, 1))
    d = max([64] + [d for d in (128, 256, 512, 1024) if per_layer(d) <= target / 4])
    base, step = states(cfg(d, 1)), per_layer(d)
    layers = max(1, math.ceil((target - base) / step) + 1)
    while layers > 1 and states(cfg(d, layers - 1)) >= target:  # the arithmetic is exact;
        layers -= 1  # these two loops only guard it
    while states(cfg(d, layers)) < target and layers < 1000:
        layers += 1
    return cfg(d, layers)


def checkpoint_model(mb: float, *, seed: int = 0, vocab: int = 256, seq_len: int = 64):
    """``(cfg, opt, state, like)``: :func:`checkpoint_config`'s GPT at stage 3 over all
    devices after one ``adamw`` step (so Adam's moments are not zeros, which compress)."""
    cfg = checkpoint_config(mb, vocab=vocab, seq_len=seq_len)
    init_fn = functools.partial(gpt.init_params, cfg, jax.random.key(seed))
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(adamw(), mesh, stage=3)
    state = opt.init(init_fn=init_fn)
    n = mesh.shape["data"]
    tokens = jax.random.randint(jax.random.key(seed + 1), (n, seq_len + 1), 0, vocab)
    batch = {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("data")))}
    state, _ = opt.train_step(gpt.make_loss_fn(cfg), manual_gather=True)(state, batch)
    return cfg, opt, jax.block_until_ready(state), jax.eval_shape(init_fn)


def _true_bytes(stored) -> int:
    """Bytes of the leaves at their true (unpadded) shapes."""
    return sum(math.prod(s.layout.shape) * np.dtype(s.dtype).itemsize for s in stored)


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def _checkpoint_rep(opt, other, state, like, directory: str) -> tuple[dict[str, float], int, int]:
    """One repetition in ``directory``: the five times (s), checkpoint and export bytes."""
    times: dict[str, float] = {}
    ckpt = jzero.Checkpointer(os.path.join(directory, "ckpt"))
    try:
        start = time.perf_counter()
        ckpt.save(int(state.step), state)
        times["save_blocking"] = time.perf_counter() - start
        ckpt.wait()
        times["save_total"] = time.perf_counter() - start
        written = _dir_bytes(ckpt.directory)
        for name, target in (("restore_same", opt), ("restore_other", other)):
            start = time.perf_counter()
            restored = ckpt.restore(target, like)
            jax.block_until_ready(restored.state)
            times[name] = time.perf_counter() - start
            del restored
    finally:
        ckpt.close()
    path = os.path.join(directory, "model.safetensors")
    start = time.perf_counter()
    jzero.checkpoint.export_safetensors(opt, state, path)
    times["export"] = time.perf_counter() - start
    return times, written, os.path.getsize(path)


def bench_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """docs/design.md §5's ``checkpoint`` object (fields: benchmarks/README.md)."""
    cfg, opt, state, like = checkpoint_model(args.checkpoint_mb, seed=args.seed)
    plan = state.plan
    params_bytes = _true_bytes(plan.master if plan.master is not None else plan.params)
    state_bytes = _true_bytes(plan.params) + _true_bytes(plan.opt)
    state_bytes += _true_bytes(plan.master) if plan.master is not None else 0
    devices = jax.devices()[: plan.data_size]
    half = max(1, len(devices) // 2)
    other = jzero.ZeroOptimizer(adamw(), jzero.data_mesh(devices[:half]), stage=1)
    reps, written, exported = [], [], []
    with tempfile.TemporaryDirectory(prefix="jzero-bench-ckpt-") as tmp:
        for rep in range(1 + args.checkpoint_reps):  # the first, untimed one compiles
            directory = os.path.join(tmp, f"rep{rep}")
            os.makedirs(directory)
            times, ckpt_bytes, export_bytes = _checkpoint_rep(opt, other, state, like, directory)
            reps.append(times)
            written.append(ckpt_bytes)
            exported.append(export_bytes)
    ops = {}
    for op in CKPT_OPS:
        nbytes = params_bytes if op == "export" else state_bytes
        seconds = float(statistics.median(r[op] for r in reps[1:]))
        ops[op] = {
            "bytes": int(nbytes),
            "seconds": seconds,
            "mb_per_s": nbytes / 1e6 / seconds,
            "seconds_reps": [float(r[op]) for r in reps[1:]],
            "seconds_cold": float(reps[0][op]),
        }
    name = f"gpt-L{cfg.n_layers}-d{cfg.d_model}-h{cfg.n_heads}-T{cfg.seq_len}-V{cfg.vocab_size}"
    return {
        "model": {
            "name": name,
            "params": int(gpt.count_params(like)),
            "layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "dtype": jnp.dtype(cfg.dtype).name,
        },
        "optimizer": ADAMW,
        "stage": plan.stage,
        "devices": plan.data_size,
        "restore_other": {"stage": other.stage, "devices": other.data_size},
        "state_bytes": int(state_bytes),
        "params_bytes": int(params_bytes),
        "bytes_written": int(statistics.median_low(written[1:])),
        "export_bytes_written": int(statistics.median_low(exported[1:])),
        "reps": args.checkpoint_reps,
        "ops": ops,
    }


def checkpoint_table(ck: dict[str, Any]) -> str:
    """The ``checkpoint`` object as a head line and an aligned table (MB = 1e6 bytes)."""
    m, other = ck["model"], ck["restore_other"]
    head = (
        f"checkpoint: {m['name']}: {m['params']:,} params ({m['dtype']}), stage "
        f"{ck['stage']} on {ck['devices']} devices; state {ck['state_bytes'] / 1e6:,.1f} MB "
        f"(params + optimizer state), {ck['bytes_written'] / 1e6:,.1f} MB written; median "
        f"of {ck['reps']} (cold: the first, untimed run)"
    )
    labels = {
        "save_blocking": "save (returns)",
        "save_total": "save (on disk)",
        "restore_same": f"restore (stage {ck['stage']}, {ck['devices']} devices)",
        "restore_other": f"restore (stage {other['stage']}, {other['devices']} devices)",
        "export": "export_safetensors (params)",
    }
    rows = [("operation", "MB", "s", "MB/s", "cold s")]
    for op in CKPT_OPS:
        r = ck["ops"][op]
        rows.append((
            labels[op], f"{r['bytes'] / 1e6:,.1f}", f"{r['seconds']:.3f}",
            f"{r['mb_per_s']:,.1f}", f"{r['seconds_cold']:.3f}",
        ))  # fmt: skip
    return "\n".join([head, _table.table(rows, right={1, 2, 3, 4})])
