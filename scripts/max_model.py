"""The largest GPT whose jzero train step fits a per-device budget, per ZeRO stage and with
the optimizer offloaded: the ZeRO paper's Table 2 and ZeRO-Offload's claim, measured.

``scripts/bench.py --max-model BUDGET`` runs :func:`bench_max_model`; benchmarks/README.md
documents the JSON it returns. Each entry of :data:`ENTRIES` (``--max-model-runs``: a
subset) is searched by compiling only: the most layers of ``examples/gpt.py`` at a fixed
width whose compiled step's device peak (``argument + output + temp - alias`` of
``memory_analysis()``; the ``host_*`` fields, host memory, are recorded apart) fits the
budget. With ``--max-model-train STEPS`` each found model is then trained for real: its
state initialised on the devices and the search's compiled step run ``--warmup`` + STEPS
times on random tokens, the median step time reported per token. A step that runs out of
device memory is retried a few layers lower (:func:`train_largest`), so ``train.layers``
is the largest depth that both compiled within the budget and trained.

The offload target (``zero3_offload`` against ``zero3``, the same stage with and without
``offload="optimizer"``): at least :data:`OFFLOAD_PARAMS` x the parameters at most
:data:`OFFLOAD_TIME` x the time per token. Only a GPU can show it: XLA:CPU has one memory,
so host memory saves nothing there.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import gpt  # examples/gpt.py (scripts/bench.py puts examples/ on sys.path)
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero import _table
from jzero.accounting.estimate import transformer_activation_bytes
from jzero.cli.units import parse_bytes


class Entry(NamedTuple):
    """One configuration of the search."""

    name: str
    stage: int
    offload: str | None  # ZeroOptimizer(offload=...)


ENTRIES = (
    Entry("dp", 0, None),
    Entry("zero1", 1, None),
    Entry("zero2", 2, None),
    Entry("zero3", 3, None),
    Entry("zero3_offload", 3, "optimizer"),
)
TARGET = 7.0  # zero3 / dp parameters (theory: N = 8 for model states alone)
OFFLOAD_PARAMS = 1.8  # zero3_offload / zero3 parameters, at least
OFFLOAD_TIME = 3.0  # zero3_offload / zero3 step time per token, at most
MAX_LAYERS = 100_000
OOM_RETRIES = 4  # device out-of-memory retries of a training, each a few layers lower


class Compiled(NamedTuple):
    """One compiled train step of the family and its memory per device."""

    executable: Any  # jax.stages.Compiled, called with a live state and batch
    peak: int  # device memory: argument + output + temp - alias
    host: int  # host memory (offloaded state): the host_* fields likewise; 0 on CPU


def family_config(args: argparse.Namespace, layers: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
        n_heads=args.heads, n_layers=layers, dtype=jnp.float32,
    )  # fmt: skip


def family_params(args: argparse.Namespace, layers: int) -> int:
    init_fn = functools.partial(gpt.init_params, family_config(args, layers), jax.random.key(0))
    return gpt.count_params(jax.eval_shape(init_fn))


def _optimizer(entry: Entry, make_tx: Callable[[], optax.GradientTransformation]):
    return jzero.ZeroOptimizer(
        make_tx(), jzero.data_mesh(), stage=entry.stage, offload=entry.offload
    )


def compile_step(
    args: argparse.Namespace, *, entry: Entry, layers: int, batch: int, make_tx: Callable
) -> Compiled:
    """The entry's jzero train step (``manual_gather=True``) of the family's GPT with
    ``layers`` blocks over all devices, compiled from ``ShapeDtypeStruct`` s (the state
    from ``jax.eval_shape`` of ``init_program``, with its planned shardings): nothing runs."""
    cfg = family_config(args, layers)
    opt = _optimizer(entry, make_tx)
    state = jax.eval_shape(*opt.init_program(init_fn=_init_fn(cfg)))
    tokens = jax.ShapeDtypeStruct(
        (batch, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(opt.mesh, P("data"))
    )
    step = opt.train_step(gpt.make_loss_fn(cfg), manual_gather=True)
    executable = step.lower(state, {"tokens": tokens}).compile()
    m = executable.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    host = m.host_argument_size_in_bytes + m.host_output_size_in_bytes
    host += m.host_temp_size_in_bytes - m.host_alias_size_in_bytes
    return Compiled(executable, int(peak - m.alias_size_in_bytes), int(host))


def _init_fn(cfg: gpt.GPTConfig) -> Callable[[], Any]:
    return functools.partial(gpt.init_params, cfg, jax.random.key(0))


def largest_fitting(
    peak, budget: float, guess: int, known: dict[int, int] | None = None
) -> tuple[int, dict[int, int]]:
    """The largest ``L >= 1`` with ``peak(L) <= budget`` (``peak`` nondecreasing in L), by
    a doubling search outward from ``guess`` and then bisection; also every ``peak`` known
    (``known``: peaks computed before) or computed. Raises ValueError if one layer does not
    fit."""
    seen: dict[int, int] = dict(known or {})

    def fits(layers: int) -> bool:
        if layers not in seen:
            seen[layers] = peak(layers)
        return seen[layers] <= budget

    over = [L for L, p in seen.items() if p > budget]
    lo = max([L for L, p in seen.items() if p <= budget], default=0)
    hi = min(over) if over else None  # peak(lo) fits (lo = 0: none known), peak(hi) does not
    if lo == 0 and not fits(1):
        raise ValueError(f"one layer does not fit in {budget:,.0f} bytes: {seen[1]:,} bytes")
    lo = max(lo, 1)
    guess = min(max(guess, lo), MAX_LAYERS if hi is None else hi - 1)
    if fits(guess):
        lo, step = guess, 1
        while hi is None or hi - lo > 1 and lo + step < hi:
            if lo + step > MAX_LAYERS:
                raise ValueError(f"more than {MAX_LAYERS:,} layers fit in {budget:,.0f} bytes")
            if fits(lo + step):
                lo, step = lo + step, 2 * step
            else:
                hi = lo + step
    else:
        hi, step = guess, 1
        while hi - step > lo and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(lo, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    fits(hi)
    return lo, seen


def train_largest(train: Callable[[int], dict[str, Any]], layers: int) -> dict[str, Any]:
    """``train(layers)``; if it runs out of device memory, again a few layers lower (1/32
    of them, at least one), at most :data:`OOM_RETRIES` times. Returns its result with
    ``oom_layers``: the depths that ran out.

    Raises:
        RuntimeError: out of device memory once more than allowed, or out of pinned host
            memory (each naming the fix); other errors propagate as they are.
    """
    oom: list[int] = []
    while True:
        try:
            return train(layers) | {"oom_layers": oom}
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e) and "host memory" in str(e):
                raise RuntimeError(
                    f"training {layers} layers ran out of pinned host memory (the offloaded "
                    "optimizer state): XLA caps it at 64 GiB; set "
                    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB above the entry's host bytes, within "
                    "the machine's RAM, or lower --max-model."
                ) from e
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            oom.append(layers)
            if len(oom) > OOM_RETRIES or layers == 1:
                raise RuntimeError(
                    f"training ran out of device memory at {oom} layers, though the compiled "
                    "peaks fit the budget: lower --max-model (the allocator needs room "
                    "beyond the compiled peak) or raise XLA_PYTHON_CLIENT_MEM_FRACTION."
                ) from e
            layers -= max(1, layers // 32)
        gc.collect()  # the failed attempt's arrays, held by its traceback until now


def train_steps(
    args: argparse.Namespace, *, entry: Entry, compiled: Compiled, layers: int, batch: int,
    make_tx: Callable,
) -> dict[str, Any]:  # fmt: skip
    """Initialises the entry's model with ``layers`` blocks on the devices and runs its
    compiled step ``args.warmup`` + ``args.max_model_train`` times on random tokens; the
    median time of the timed steps, per step and per token (``batch x seq_len`` predicted
    tokens a step)."""
    cfg = family_config(args, layers)
    opt = _optimizer(entry, make_tx)
    state = opt.init(init_fn=_init_fn(cfg))
    host = sum(  # the live state resting outside device memory, per device
        x.addressable_shards[0].data.nbytes
        for x in jax.tree.leaves((state.params, state.opt_state, state.master))
        if x.sharding.memory_kind not in (None, "device")
    )
    sharding = NamedSharding(opt.mesh, P("data"))
    key = jax.random.key(args.seed)
    losses, times = [], []
    for i in range(args.warmup + args.max_model_train):
        tokens = jax.random.randint(
            jax.random.fold_in(key, i), (batch, cfg.seq_len + 1), 0, cfg.vocab_size
        )
        batch_i = {"tokens": jax.device_put(tokens, sharding)}
        jax.block_until_ready(batch_i)
        start = time.perf_counter()
        state, metrics = compiled.executable(state, batch_i)
        jax.block_until_ready((state, metrics))
        if i >= args.warmup:
            times.append(1e3 * (time.perf_counter() - start))
        losses.append(float(metrics["loss"]))
    del state
    step_ms = float(statistics.median(times))
    tokens_per_step = batch * cfg.seq_len
    return {
        "layers": layers,
        "params": family_params(args, layers),
        "steps": len(times),
        "step_ms_median": step_ms,
        "tokens_per_step": tokens_per_step,
        "ms_per_token": step_ms / tokens_per_step,
        "host_bytes": int(host),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def _offload_ratios(by_name: dict[str, Any]) -> dict[str, Any] | None:
    """zero3_offload against zero3 (same stage, only the offload differs; at N = 1 also
    the only meaningful pair, as stages 0-3 then hold the same bytes): the parameters (of
    the trained models when they trained), the time per token, and whether both meet the
    target (None: not trained, so no time)."""
    if not {"zero3", "zero3_offload"} <= by_name.keys():
        return None
    base, off = by_name["zero3"], by_name["zero3_offload"]
    trained = base["train"] is not None and off["train"] is not None
    pick = lambda s: s["train"] if trained else s
    params = pick(off)["params"] / pick(base)["params"]
    time_ratio = off["train"]["ms_per_token"] / base["train"]["ms_per_token"] if trained else None
    met = None if time_ratio is None else params >= OFFLOAD_PARAMS and time_ratio <= OFFLOAD_TIME
    return {
        "base": "zero3",
        "offloaded": "zero3_offload",
        "params_ratio": params,
        "ms_per_token_ratio": time_ratio,
        "target_params_ratio": OFFLOAD_PARAMS,
        "target_ms_per_token_ratio": OFFLOAD_TIME,
        "met": met,
    }


def _search(args, entry: Entry, *, budget: float, n: int, batch: int, make_tx, family):
    """One entry's search: ``(stage fields, compiled step at the found depth)``."""
    base, per_layer = family["params_base"], family["params_per_layer"]

    def acts(layers: int) -> float:  # Korthikanti et al.'s 16-bit bytes, x2 for fp32
        return 2 * transformer_activation_bytes(
            batch=max(1, batch // n), seq=args.seq_len, hidden=args.d_model,
            layers=max(1, layers), heads=args.heads, checkpointing=True,
        )  # fmt: skip

    common = {"devices": n, "stage": entry.stage, "precision": "fp32", "offload": entry.offload}

    def est_bytes(layers: int) -> float:
        return jzero.estimate(
            params=base + layers * per_layer, largest_layer_params=per_layer,
            activation_bytes=acts(layers), **common,
        ).total_bytes  # fmt: skip

    compiled: dict[int, Compiled] = {}

    def peak(layers: int) -> int:
        compiled[layers] = compile_step(
            args, entry=entry, layers=layers, batch=batch, make_tx=make_tx
        )
        return compiled[layers].peak

    # A first guess from the estimator, then up to three secant steps: each compiles the
    # guess and moves along the line through its peak and the estimator's bytes at 0 layers
    # (the estimator's bytes per layer can be far off: offload saves nothing on CPU, and
    # past offload_chunk elements a stacked leaf streams in chunks, which costs more).
    slope = est_bytes(2) - est_bytes(1)
    zero = est_bytes(1) - slope
    guess = max(1, 1 + int((budget - est_bytes(1)) // slope))
    known: dict[int, int] = {}
    for _ in range(3):
        if guess in known:
            break
        known[guess] = peak(guess)
        if known[guess] > zero:
            slope = (known[guess] - zero) / guess
        guess = max(1, guess + math.floor((budget - known[guess]) / slope))
    layers, seen = largest_fitting(peak, budget, guess, known=known)
    # The estimator with the terms beyond model states, at the found depth: stage 3's
    # gathered layer (one block), and activations under full checkpointing.
    full = jzero.max_params(
        device_memory=budget, largest_layer_params=per_layer, activation_bytes=acts(layers),
        **common,
    )  # fmt: skip
    states_only = jzero.max_params(device_memory=budget, **common)
    fields = {
        "name": entry.name,
        "stage": entry.stage,
        "offload": entry.offload,
        "layers": layers,
        "params": base + layers * per_layer,
        "peak_bytes": seen[layers],
        "host_bytes": compiled[layers].host,
        "next_layers": layers + 1,
        "next_params": base + (layers + 1) * per_layer,
        "next_peak_bytes": seen[layers + 1],
        "estimate_params": int(full),
        "estimate_params_model_states": int(states_only),
        "compiles": len(seen),
    }
    return fields, compiled[layers]


def _train(
    args, *, entry: Entry, compiled: Compiled, layers: int, batch: int, make_tx: Callable
) -> dict[str, Any]:
    """:func:`train_steps` at the found depth with the search's executable, retried lower
    (compiled again) if it runs out of device memory."""
    kw = {"entry": entry, "batch": batch, "make_tx": make_tx}

    def train(depth: int) -> dict[str, Any]:
        executable = compiled if depth == layers else compile_step(args, layers=depth, **kw)
        return train_steps(args, compiled=executable, layers=depth, **kw)

    return train_largest(train, layers)


def bench_max_model(
    args: argparse.Namespace, *, make_tx: Callable[[], optax.GradientTransformation], optimizer: str
) -> dict[str, Any]:
    """The ``max_model`` object (fields: benchmarks/README.md). ``make_tx`` builds the
    Optax transformation every entry uses, ``optimizer`` names it in the JSON."""
    budget = parse_bytes(args.max_model)
    n = jzero.data_mesh().shape["data"]
    batch = args.batch if args.batch is not None else n
    per_layer = family_params(args, 2) - family_params(args, 1)
    family = {
        "varies": "n_layers",
        "d_model": args.d_model,
        "n_heads": args.heads,
        "seq_len": args.seq_len,
        "vocab": args.vocab,
        "batch": batch,
        "dtype": "float32",
        "optimizer": optimizer,
        "params_base": family_params(args, 1) - per_layer,  # embeddings, final LayerNorm
        "params_per_layer": per_layer,
    }
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    limit = stats.get("bytes_limit")
    if args.max_model_train and limit is not None and budget > limit:
        raise ValueError(
            f"--max-model {args.max_model} is more than the {limit:,} bytes the device "
            "allocator may use, so the found models could not train: lower the budget "
            "(about 0.85 x bytes_limit leaves room for fragmentation) or raise the "
            "allocator's share with XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75)."
        )
    wanted = args.max_model_runs.split(",")
    seconds = {"search": 0.0, "train": 0.0}
    stages = []
    for entry in (e for e in ENTRIES if e.name in wanted):
        start = time.perf_counter()
        fields, compiled = _search(
            args, entry, budget=budget, n=n, batch=batch, make_tx=make_tx, family=family
        )
        seconds["search"] += time.perf_counter() - start
        start = time.perf_counter()
        fields["train"] = None
        if args.max_model_train:
            fields["train"] = _train(
                args, entry=entry, compiled=compiled, layers=fields["layers"], batch=batch,
                make_tx=make_tx,
            )  # fmt: skip
        seconds["train"] += time.perf_counter() - start
        stages.append(fields)
    by_name = {s["name"]: s for s in stages}
    zero3_over_dp = None
    if {"dp", "zero3"} <= by_name.keys():
        zero3_over_dp = by_name["zero3"]["params"] / by_name["dp"]["params"]
    return {
        "budget": args.max_model,
        "budget_bytes": int(budget),
        "devices": n,
        "device_bytes_limit": limit,
        "family": family,
        "estimate": (
            "estimate_params: jzero.max_params(precision='fp32', offload=the entry's, "
            "largest_layer_params=one block, activation_bytes=2 x "
            "transformer_activation_bytes(checkpointing=True) at the found layers); "
            "estimate_params_model_states: model states only"
        ),
        "stages": stages,
        "zero3_over_dp": zero3_over_dp,
        "target": TARGET,
        "train": (
            {"steps": args.max_model_train, "warmup": args.warmup, "seconds": seconds["train"]}
            if args.max_model_train
            else None
        ),
        "offload": _offload_ratios(by_name),
        "search_seconds": seconds["search"],
    }


CPU_NOTE = "cpu: host memory is the same RAM, so only a GPU can show the target"


def max_model_table(mm: dict[str, Any], *, platform: str) -> str:
    """The ``max_model`` object as a head line, an aligned table (MB = 1e6 bytes), the
    trained models' table when they trained, and the target lines."""
    f = mm["family"]
    head = (
        f"largest gpt-L?-d{f['d_model']}-h{f['n_heads']}-T{f['seq_len']}-V{f['vocab']} "
        f"({f['dtype']}, batch {f['batch']}) whose compiled step fits {mm['budget']} "
        f"({mm['budget_bytes'] / 1e6:,.1f} MB) per device, {mm['devices']} devices"
    )
    rows = [(
        "run", "layers", "params", "peak MB", "L+1 peak MB", "host MB", "estimate",
        "states-only est.",
    )]  # fmt: skip
    for s in mm["stages"]:
        rows.append((
            s["name"], str(s["layers"]), f"{s['params']:,}", f"{s['peak_bytes'] / 1e6:,.2f}",
            f"{s['next_peak_bytes'] / 1e6:,.2f}", f"{s['host_bytes'] / 1e6:,.2f}",
            f"{s['estimate_params']:,}", f"{s['estimate_params_model_states']:,}",
        ))  # fmt: skip
    lines = [head, _table.table(rows, right=set(range(1, 8)))]
    if mm["train"] is not None:
        t = mm["train"]
        lines += ["", f"trained {t['steps']} steps after {t['warmup']} (median; random tokens)"]
        rows = [("run", "layers", "params", "ms/step", "tokens", "us/token", "host MB", "loss")]
        for s in mm["stages"]:
            r = s["train"]
            rows.append((
                s["name"], str(r["layers"]), f"{r['params']:,}", f"{r['step_ms_median']:,.1f}",
                f"{r['tokens_per_step']:,}", f"{1e3 * r['ms_per_token']:,.2f}",
                f"{r['host_bytes'] / 1e6:,.2f}", f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
            ))  # fmt: skip
        lines.append(_table.table(rows, right=set(range(1, 7))))
    if mm["zero3_over_dp"] is not None:
        ratio, target = mm["zero3_over_dp"], mm["target"]
        text = f"zero3 params / dp params {ratio:.2f}"
        if mm["devices"] == 1:
            lines.append(f"- {text} (one device: every stage holds the same bytes)")
        else:
            lines.append(f"{'PASS' if ratio >= target else 'FAIL'} {text} >= {target:g}")
    if (o := mm["offload"]) is not None:
        text = f"zero3_offload params / zero3 params {o['params_ratio']:.2f} >= {OFFLOAD_PARAMS:g}"
        if o["met"] is None:
            lines.append(f"- {text}; time per token not measured (--max-model-train STEPS)")
        else:
            verdict = "PASS" if o["met"] else "FAIL"
            t = o["ms_per_token_ratio"]
            text = f"{verdict} {text} at time per token {t:.2f} x <= {OFFLOAD_TIME:g} x"
            lines.append(text + (f" ({CPU_NOTE})" if platform == "cpu" else ""))
    return "\n".join(lines)
