"""The GPU check's ``offload`` piece: per offload mode, the largest GPT of
``examples/gpt.py``'s family (more layers at a fixed width) whose stage-3 step runs, and
its time per token.

Each mode is one part, run in its own process (``--only offload:host_step``): the most
layers whose compiled step fits the device budget *and* whose state at rest outside the
device fits the host budget (``scripts/max_model.py``'s compile-only search, fitting
whichever binds), then that model trained a few steps (its OOM retries included). The
host-step modes are also trained at the ``none`` mode's size, for the time comparison.

Modes: ``none``; ``streamed`` (``offload="optimizer"``: optimizer state in pinned host,
streamed through the device); ``host_step`` (``jzero.Offload(optimizer="host")``: the
update on the host CPU); ``host_step_params`` (``jzero.Offload(optimizer="host",
params=True)``: stage-3 parameters at rest in pinned host too). A mode this build lacks is
recorded as skipped.

Targets (:func:`targets`): ``host_step_params`` rests more host bytes per parameter than
``host_step`` (its parameters are on the host), and for each host-step mode: its model
reaches at least
:data:`HOST_SHARE` of the size host memory allows (its host bytes per parameter times its
parameters against the pinned-host limit: on the lent H200, 139 GiB of GPU memory against
128 GiB of host memory, host memory binds, so "N x larger" is the wrong yardstick), and
at the ``none`` mode's size its time per token is at most :data:`TIME_RATIO` x none's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import max_model  # scripts/max_model.py
import offload_bench  # scripts/offload_bench.py
from benchmark.runs import adamw  # scripts/benchmark/runs.py

import jzero
from jzero.accounting.memory_spaces import replay
from jzero.cli.units import parse_bytes

from .common import Context, skip, target


class Mode(NamedTuple):
    """One way of placing the optimizer (and parameters) of the offload piece."""

    name: str
    offload: Callable[[], Any]  # ZeroOptimizer(offload=...); may raise on an older build
    host_step: bool  # the optimizer steps on the host: the host-size targets apply


MODES = {
    m.name: m
    for m in (
        Mode("none", lambda: None, False),
        Mode("streamed", lambda: "optimizer", False),
        Mode("host_step", lambda: jzero.Offload(optimizer="host"), True),
        Mode("host_step_params", lambda: jzero.Offload(optimizer="host", params=True), True),
        Mode(
            "host_delayed", lambda: jzero.Offload(optimizer="host", delay=1, exact_steps=0), True
        ),  # fmt: skip
        Mode("ratio_half", lambda: jzero.Offload(optimizer="host", ratio=0.5), True),
    )
}
PARTS = tuple(MODES)
SIZES = {  # the family (width fixed, layers searched), batch, steps; dry: budgets too
    "gpu": {"d_model": 2048, "heads": 16, "seq_len": 1024, "vocab": 256, "batch": 4,
            "warmup": 1, "steps": 3},
    "dry": {"d_model": 32, "heads": 2, "seq_len": 16, "vocab": 256, "batch": 1,
            "warmup": 1, "steps": 1, "device_budget": "2MB", "host_budget": "0.5MB"},
}  # fmt: skip
DEVICE_SHARE = 0.85  # of the allocator's limit: room for fragmentation (max_model's advice)
HOST_MARGIN = 0.95  # the search keeps host bytes within this share of the pinned limit
PINNED_DEFAULT_GIB = 64  # XLA's pinned-host cap on GPU without XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
HOST_SHARE = 0.9  # host-step params / params the pinned-host limit allows, at least
TIME_RATIO = 2.0  # host-step ms per token / none's, at none's size, at most


def _args(s: dict[str, Any]) -> argparse.Namespace:
    """The namespace ``scripts/max_model.py``'s functions read."""
    return argparse.Namespace(
        vocab=s["vocab"], seq_len=s["seq_len"], d_model=s["d_model"], heads=s["heads"],
        seed=0, warmup=s["warmup"], max_model_train=s["steps"],
    )  # fmt: skip


def budgets(ctx: Context, s: dict[str, Any]) -> dict[str, int]:
    """Device and host budgets in bytes, and the pinned-host limit the target uses."""
    if ctx.dry_run:
        host = int(parse_bytes(s["host_budget"]))
        return {"device": int(parse_bytes(s["device_budget"])), "host": host, "host_limit": host}
    limit = jax.devices()[0].memory_stats()["bytes_limit"]
    gib = float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", PINNED_DEFAULT_GIB))
    pinned = int(gib * 2**30)
    return {"device": int(DEVICE_SHARE * limit), "host": int(HOST_MARGIN * pinned),
            "host_limit": pinned}  # fmt: skip


def _off_device(sharding: Any) -> bool:
    """A leaf at rest outside the accelerator: a host memory kind, or on the CPU backend
    while the default backend is another (a host-side optimizer's state)."""
    if getattr(sharding, "memory_kind", None) not in (None, "device"):
        return True
    default = jax.default_backend()
    return default != "cpu" and any(d.platform == "cpu" for d in sharding.device_set)


def state_host_bytes(args: argparse.Namespace, entry: max_model.Entry, layers: int) -> int:
    """Bytes per device of the planned state resting outside the device (abstract:
    ``jax.eval_shape`` of ``init_program``, nothing allocated)."""
    opt = max_model._optimizer(entry, adamw)
    cfg = max_model.family_config(args, layers)
    state = jax.eval_shape(*opt.init_program(init_fn=max_model._init_fn(cfg)))
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(state)
        if _off_device(x.sharding)
    )


def search(args, entry: max_model.Entry, *, batch: int, budget: dict[str, int]):
    """The most layers whose compiled step fits ``budget["device"]`` and whose state at
    rest outside the device fits ``budget["host"]``: ``(fields, compiled step)``. The
    host bytes are scaled onto the device budget so one search fits whichever binds."""
    found: dict[int, tuple[max_model.Compiled, int]] = {}
    scale = budget["device"] / budget["host"]

    def fit(layers: int) -> float:
        c = max_model.compile_step(args, entry=entry, layers=layers, batch=batch,
                                   make_tx=adamw)  # fmt: skip
        host = max(c.host, state_host_bytes(args, entry, layers))
        found[layers] = (c, host)
        return max(c.peak, host * scale)

    known = {1: fit(1), 2: fit(2)}
    slope = max(known[2] - known[1], 1.0)
    guess = max(1, 1 + math.floor((budget["device"] - known[1]) / slope))
    layers, seen = max_model.largest_fitting(fit, budget["device"], guess, known=known)
    c, host = found[layers]
    per_layer = max_model.family_params(args, 2) - max_model.family_params(args, 1)
    fields = {
        "layers": layers,
        "params": max_model.family_params(args, layers),
        "peak_bytes": c.peak,
        "host_bytes": host,
        "binds": "host" if host * scale >= c.peak else "device",
        "next_layers_fit_bytes": seen.get(layers + 1),  # max(peak, scaled host): > budget
        "params_per_layer": per_layer,
        "compiles": len(seen),
    }
    return fields, c


def _available(mode: Mode) -> str | None:
    """None if this build has the mode, else why not."""
    try:
        jzero.ZeroOptimizer(adamw(), jzero.data_mesh(), stage=3, offload=mode.offload())
    except (AttributeError, TypeError, ValueError) as e:
        return f"skipped: mode not available in this build ({type(e).__name__}: {e})"
    return None


def run(ctx: Context, part: str, earlier: dict[str, Any]) -> dict[str, Any]:
    """One mode's search and training; host-step modes also train at none's size (from
    ``earlier["none"]``, this run's or the JSON's)."""
    mode, s = MODES[part], SIZES["dry" if ctx.dry_run else "gpu"]
    if (reason := _available(mode)) is not None:
        return {"skipped": reason, "targets": []}
    args, budget = _args(s), budgets(ctx, s)
    batch = s["batch"] * jax.device_count()
    entry = max_model.Entry(f"zero3_{part}", 3, mode.offload())
    fields, compiled = search(args, entry, batch=batch, budget=budget)
    kw = {"entry": entry, "batch": batch, "make_tx": adamw}
    trained = max_model._train(args, compiled=compiled, layers=fields["layers"], **kw)
    result = {"sizes": s, "budget": budget, "search": fields, "train": trained}
    none = (earlier.get("none") or {}).get("train")
    if mode.host_step and none is not None:
        at = none["layers"]
        step = max_model.compile_step(args, layers=at, **kw)
        result["train_at_none_size"] = max_model.train_steps(args, compiled=step, layers=at, **kw)
    return result | {"targets": []}


def _host_targets(name: str, part: dict[str, Any], none: dict[str, Any] | None) -> list:
    search, trained = part["search"], part["train"]
    per_param = search["host_bytes"] / search["params"]
    allowed = part["budget"]["host_limit"] / per_param
    share = trained["params"] / allowed
    text = (
        f"{name} params {trained['params']:,} / the {allowed:,.0f} the pinned-host limit "
        f"allows at {per_param:.2f} host bytes per parameter: {share:.3f} >= {HOST_SHARE}"
    )
    ok = share >= HOST_SHARE
    found = [target(f"offload {name} size", ok, text, measured=share, bound=HOST_SHARE)]
    if none is None or "train_at_none_size" not in part:
        return found + [skip(f"offload {name} time", "skipped: needs offload:none's result "
                             "first (run --only offload:none, then this mode)")]  # fmt: skip
    ratio = part["train_at_none_size"]["ms_per_token"] / none["train"]["ms_per_token"]
    text = f"{name} ms per token / none's at none's size {ratio:.3f} <= {TIME_RATIO}"
    return found + [target(f"offload {name} time", ratio <= TIME_RATIO, text, measured=ratio,
                           bound=TIME_RATIO)]  # fmt: skip


def _not_checked(name: str, part: dict[str, Any] | None) -> str:
    """Why a mode's targets are not checked: not run, not in this build, or failed."""
    if part is None:
        return f"skipped: not run yet (--only offload:{name})"
    if part.get("skipped"):
        return part["skipped"]
    return f"skipped: offload:{name} failed (its error is in its part)"


def _params_on_host(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``params=True`` rests more host bytes per parameter than the host step alone (its
    parameter shards): a mode that builds but leaves the parameters on the device fails."""
    name = "offload host_step_params params on host"
    a, b = parts.get("host_step") or {}, parts.get("host_step_params") or {}
    if "search" not in a or "search" not in b:
        return skip(name, "skipped: needs offload:host_step and offload:host_step_params")
    per_param = lambda p: p["search"]["host_bytes"] / p["search"]["params"]
    extra = per_param(b) - per_param(a)
    text = f"host_step_params host bytes per parameter - host_step's {extra:.2f} > 0"
    return target(name, extra > 0, text, measured=extra, bound=0.0)


def targets(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The host-step modes' targets, from the parts recorded so far."""
    found = []
    none = parts.get("none")
    none = none if none and "train" in none else None
    for name, mode in MODES.items():
        if not mode.host_step:
            continue
        part = parts.get(name)
        if part is None or "train" not in part:
            why = _not_checked(name, part)
            found += [skip(f"offload {name} size", why), skip(f"offload {name} time", why)]
        else:
            found += _host_targets(name, part, none)
    return found + [_params_on_host(parts)]


# ------------------------------------------- the quick check's fixed-size comparison
FIXED_PARTS = ("none", "host_step")
FIXED_LAYERS = {"gpu": 24, "dry": 2}  # gpu: d_model 2048 x 24 layers, 1.21 B params
FIXED_PEAK = 0.6  # host step's allocator peak / none's, at most (ZeRO-Offload's promise)
FIXED_TIME = 3.0  # host step's step time / none's at one micro-batch (4 K tokens), at most
FIXED_MICRO = {"gpu": 8, "dry": 2}  # micro-batches a step of the ``offload_32k`` piece
ACCUM_TIME = {"host_step": 1.3, "host_delayed": 1.1, "streamed": 2.0}  # / none's, at most,
# at FIXED_MICRO micro-batches (32 K tokens): ZeRO-Offload's update hidden behind the device
STREAM_SAVED = 0.8  # streamed: (none's peak - its peak) / its state at rest on the host, at least
ALLOCATOR_MARGIN = 0.1  # |allocator peak / compiled device peak - 1|, at most, per mode
LINK_PROBE_BYTES = {"gpu": 2**28, "dry": 2**20}  # one buffer timed each way over the link
LINK_MARGIN = 1.1  # streamed step <= none's + this x its copies' time (2 x state / link)


def _allocator_peak() -> int | None:
    """The device allocator's ``peak_bytes_in_use`` in this process (None on CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def link_bytes_per_s(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """The link's bandwidth each way, from the median of ``repeats`` timed moves of one
    ``nbytes`` buffer (after one untimed move each way): device memory to pinned host
    (``down``) and back (``up``)."""
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), jax.devices()[0])
    host, device = (x.sharding.with_memory_kind(k) for k in ("pinned_host", "device"))

    def timed(src: jax.Array, dst: Any) -> tuple[jax.Array, float]:
        start = time.perf_counter()
        moved = jax.device_put(src, dst).block_until_ready()
        return moved, time.perf_counter() - start

    down, up = [], []
    for _ in range(repeats + 1):
        on_host, seconds = timed(x, host)
        down.append(seconds)
        up.append(timed(on_host, device)[1])
    return {"down": nbytes / statistics.median(down[1:]), "up": nbytes / statistics.median(up[1:])}


def fixed(ctx: Context, part: str, earlier: dict[str, Any], micro: int = 1) -> dict[str, Any]:
    """One mode trained at one fixed size (no search), ``micro`` micro-batches a step: its
    compiled peak, the allocator's peak and its step time. Each mode runs in its own
    process, so the allocator's peak is the mode's alone."""
    del earlier
    mode, s = MODES[part], SIZES["dry" if ctx.dry_run else "gpu"]
    if (reason := _available(mode)) is not None:
        return {"skipped": reason, "targets": []}
    args, layers = _args(s), FIXED_LAYERS["dry" if ctx.dry_run else "gpu"]
    batch = s["batch"] * jax.device_count() * micro
    kw = {"entry": max_model.Entry(f"zero3_{part}", 3, mode.offload()), "batch": batch,
          "make_tx": adamw}  # fmt: skip
    step = max_model.compile_step(args, layers=layers, grad_accum=micro, **kw)
    at_rest = state_host_bytes(args, kw["entry"], layers)  # the state resting off the device
    trained = max_model.train_steps(args, compiled=step, layers=layers, **kw)
    found = {"sizes": s, "layers": layers, "compiled_peak_bytes": step.peak,
             "replay_peak_bytes": replay(step.executable.as_text()),
             "host_bytes": max(step.host, at_rest), "host_bytes_at_rest": at_rest,
             "allocator_peak_bytes": _allocator_peak(), "train": trained,
             "targets": []}  # fmt: skip
    if part == "streamed":  # what bounds its time: 2 x its state over the link
        probe = LINK_PROBE_BYTES["dry" if ctx.dry_run else "gpu"]
        found["link_bytes_per_s"] = link_bytes_per_s(probe)
    return found


def fixed_accum(ctx: Context, part: str, earlier: dict[str, Any]) -> dict[str, Any]:
    """:func:`fixed` at FIXED_MICRO micro-batches a step (32 K tokens on the GPU)."""
    return fixed(ctx, part, earlier, micro=FIXED_MICRO["dry" if ctx.dry_run else "gpu"])


def accum_targets(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """At FIXED_MICRO micro-batches a step: each offloaded mode's step time against none's
    (ACCUM_TIME), and ``ratio_half``'s peak and time between none's and the host step's."""
    none, found = parts.get("none") or {}, []
    for name, bound in ACCUM_TIME.items():
        title, run = f"offload 32k {name} time", parts.get(name) or {}
        if "train" not in none or "train" not in run:
            why = f"skipped: needs offload_32k:none and offload_32k:{name}"
            found.append(skip(title, run.get("skipped") or why))
            continue
        ratio = run["train"]["step_ms_median"] / none["train"]["step_ms_median"]
        tokens = run["train"]["tokens_per_step"]
        text = f"{name} step time / none's at {tokens:,} tokens a step {ratio:.3f} <= {bound}"
        found.append(target(title, ratio <= bound, text, measured=ratio, bound=bound))
    ends = (none, parts.get("host_step") or {})
    return found + _ratio_fixed(*ends, parts.get("ratio_half") or {}, piece="offload 32k")


def fixed_targets(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """At the fixed size: the host step against none (allocator peak, step time), the
    streamed mode's saving against the state it offloads, and each mode's allocator peak
    against its compiled device peak."""
    none, host = parts.get("none") or {}, parts.get("host_step") or {}
    names = ("offload fixed host_step peak", "offload fixed host_step time")
    if "train" not in none or "train" not in host:
        why = "skipped: needs offload_fixed:none and offload_fixed:host_step"
        found = [skip(n, host.get("skipped") or why) for n in names]
    else:
        found = _host_step_fixed(none, host, names)
    found += _streamed_fixed(none, parts.get("streamed") or {})
    found += _streamed_bound(none, parts.get("streamed") or {})
    return found + _ratio_fixed(none, host, parts.get("ratio_half") or {}) + _agreement(parts)


def _ratio_fixed(
    none: dict, host: dict, half: dict, piece: str = "offload fixed"
) -> list[dict[str, Any]]:
    """``ratio_half``'s allocator peak and step time between no offload's and the host
    step's (its share of the state on the host is what its whole leaves allow)."""
    found, unit = [], piece.replace("offload ", "offload_")
    for name, key in (("peak", "allocator_peak_bytes"), ("time", "step_ms_median")):
        title = f"{piece} ratio_half {name} between the ends"
        runs = (none, half, host)
        if any("train" not in r for r in runs):
            why = f"skipped: needs {unit}:none, host_step and ratio_half"
            found.append(skip(title, half.get("skipped") or why))
            continue
        low, mid, high = (r[key] if key in r else r["train"][key] for r in runs)
        if None in (low, mid, high):
            found.append(skip(title, "skipped: no allocator statistics (CPU)"))
            continue
        lo, hi = min(low, high), max(low, high)
        where = (mid - lo) / (hi - lo) if hi > lo else 0.0
        text = f"ratio_half {name} at {where:.3f} of the way from the lower end to the upper"
        found.append(target(title, lo <= mid <= hi, text, measured=float(where), bound=[0, 1]))
    return found


def _host_step_fixed(none: dict, host: dict, names: tuple[str, str]) -> list[dict[str, Any]]:
    time_ratio = host["train"]["step_ms_median"] / none["train"]["step_ms_median"]
    found = [target(names[1], time_ratio <= FIXED_TIME,
                    f"host_step step time / none's at {host['train']['params']:,} params "
                    f"{time_ratio:.3f} <= {FIXED_TIME}", measured=time_ratio,
                    bound=FIXED_TIME)]  # fmt: skip
    if none["allocator_peak_bytes"] is None or host["allocator_peak_bytes"] is None:
        return [skip(names[0], "skipped: no allocator statistics (CPU)"), *found]
    peak = host["allocator_peak_bytes"] / none["allocator_peak_bytes"]
    text = f"host_step allocator peak / none's {peak:.3f} <= {FIXED_PEAK}"
    return [target(names[0], peak <= FIXED_PEAK, text, measured=peak, bound=FIXED_PEAK), *found]


def _streamed_fixed(none: dict, streamed: dict) -> list[dict[str, Any]]:
    """The streamed mode's allocator peak below none's by >= STREAM_SAVED of its state."""
    name = "offload fixed streamed peak"
    if "train" not in none or "train" not in streamed:
        why = "skipped: needs offload_fixed:none and offload_fixed:streamed"
        return [skip(name, streamed.get("skipped") or why)]
    if none["allocator_peak_bytes"] is None or streamed["allocator_peak_bytes"] is None:
        return [skip(name, "skipped: no allocator statistics (CPU)")]
    saved = none["allocator_peak_bytes"] - streamed["allocator_peak_bytes"]
    share = saved / streamed["host_bytes_at_rest"]
    text = (
        f"streamed saves {saved:,} B of none's allocator peak = {share:.3f} x the "
        f"{streamed['host_bytes_at_rest']:,} B of state it offloads >= {STREAM_SAVED}"
    )
    return [target(name, share >= STREAM_SAVED, text, measured=share, bound=STREAM_SAVED)]


def _streamed_bound(none: dict, streamed: dict) -> list[dict[str, Any]]:
    """The streamed step bounded by its copies, not by serialisation: at most none's step
    plus LINK_MARGIN x the time its state takes down and up the link (2 x the state at
    rest: tests/core/offload/test_offload.py checks that the step moves exactly that)."""
    name = "offload fixed streamed bounded by its copies"
    if "train" not in none or "link_bytes_per_s" not in streamed:
        why = "skipped: needs offload_fixed:none and offload_fixed:streamed"
        return [skip(name, streamed.get("skipped") or why)]
    link, state = streamed["link_bytes_per_s"], streamed["host_bytes_at_rest"]
    copies_ms = 1e3 * (state / link["down"] + state / link["up"])
    none_ms, ms = none["train"]["step_ms_median"], streamed["train"]["step_ms_median"]
    bound = none_ms + LINK_MARGIN * copies_ms
    text = (
        f"streamed step {ms:.1f} ms <= none's {none_ms:.1f} ms + {LINK_MARGIN} x "
        f"{copies_ms:.1f} ms (2 x {state:,} B over {link['down'] / 1e9:.1f} GB/s down, "
        f"{link['up'] / 1e9:.1f} GB/s up) = {bound:.1f} ms"
    )
    return [target(name, ms <= bound, text, measured=ms, bound=bound)]


def _agreement(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trained mode's allocator peak against its compiled device peak."""
    found = []
    for part, r in parts.items():
        name = f"offload fixed {part} allocator vs compiled"
        if "train" not in r or r["allocator_peak_bytes"] is None:
            found.append(skip(name, r.get("skipped") or "skipped: no allocator statistics"))
            continue
        off = r["allocator_peak_bytes"] / r["compiled_peak_bytes"] - 1
        text = (
            f"{part}: allocator peak {r['allocator_peak_bytes']:,} B vs compiled device "
            f"peak {r['compiled_peak_bytes']:,} B ({100 * off:+.1f}%), within "
            f"{100 * ALLOCATOR_MARGIN:g}%"
        )
        found.append(target(name, abs(off) <= ALLOCATOR_MARGIN, text, measured=off,
                            bound=ALLOCATOR_MARGIN))  # fmt: skip
    return found


# ----------------------------------------------- the host update's rate on the GPU's host
HOST_RATE = {  # parameters updated, and the leaves they are split into (one host
    "gpu": {"params": 2**26, "leaves": (1, 8, 32), "triad_elements": 2**26},  # computation
    "dry": {"params": 2**16, "leaves": (1, 8), "triad_elements": 2**20},  # each)
}


def host_rate(ctx: Context) -> dict[str, Any]:
    """The host step's update alone on this machine's host (``Offload(optimizer="host")``:
    one host computation per parameter leaf), AdamW with bf16 parameters and fp32 master
    weights, the same parameters split into 1, 8 and 32 leaves, against the STREAM triad
    on every core the process may use and on one. On a GPU, XLA runs each host computation
    on one thread of its pool, so the rate a model reaches depends on how many leaves it
    has (a scanned model: few); on CPU the computations are inlined into the step. Target:
    the best rate >= offload_bench.TRIAD_SHARE x the all-core triad (P20, section 1)."""
    s = HOST_RATE["dry" if ctx.dry_run else "gpu"]
    cores = len(os.sched_getaffinity(0))
    elements = s["triad_elements"]
    triad = {"threads": cores, "threads_bytes_per_s": offload_bench.triad(cores, elements),
             "one_thread_bytes_per_s": offload_bench.triad(1, elements)}  # fmt: skip
    by_leaves = {}
    for n in s["leaves"]:
        rows = s["params"] // n // 1024
        params = {f"w{i}": jnp.full((rows, 1024), 0.01, jnp.float32) for i in range(n)}
        by_leaves[str(n)] = offload_bench.update_alone(jzero.Offload(optimizer="host"), params)
    best = max(u["bytes_per_s"] for u in by_leaves.values())
    share, bound = best / triad["threads_bytes_per_s"], offload_bench.TRIAD_SHARE
    rates = ", ".join(f"{n} leaves {u['bytes_per_s'] / 1e9:.1f}" for n, u in by_leaves.items())
    text = (
        f"host update {best / 1e9:.1f} GB/s (best of {rates} GB/s) = {share:.2f} x the "
        f"{cores}-thread triad's {triad['threads_bytes_per_s'] / 1e9:.1f} GB/s >= {bound}"
    )
    found = [target("host_rate update vs triad", share >= bound, text, measured=share,
                    bound=bound)]  # fmt: skip
    return {"triad": triad, "update_by_leaves": by_leaves, "targets": found}
