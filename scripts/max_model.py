"""The largest GPT whose jzero train step fits a per-device budget, per ZeRO stage and with
the optimizer offloaded: the ZeRO paper's Table 2 and ZeRO-Offload's claim, measured.

``scripts/bench.py --max-model BUDGET`` runs :func:`bench_max_model`; benchmarks/README.md
documents the JSON it returns. Each entry of :data:`ENTRIES` (``--max-model-runs``: a
subset) is searched by compiling only: the most layers of ``examples/gpt.py`` at a fixed
width whose compiled step's *device* peak fits the budget. The peak is read per memory
space from the compiled program (:func:`jzero.accounting.memory_spaces.peak_by_space`:
its schedule replayed, host-memory buffers apart), so an offload's saving shows on any
backend; XLA's own ``memory_analysis()`` peak (one memory on XLA:CPU) is recorded beside
it. With ``--max-model-train STEPS`` each found model is then trained for real: its
state initialised on the devices and the search's compiled step run ``--warmup`` + STEPS
times on random tokens, the median step time reported per token. A step that runs out of
device memory is retried a few layers lower (:func:`train_largest`), so ``train.layers``
is the largest depth that both compiled within the budget and trained.

The offload targets (:data:`OFFLOAD_TARGETS`): stage 3 with the host step holds at least
1.8 x stage 3's parameters in fp32 (the device keeps 8 of 16 bytes per parameter), and
at least 3.5 x in bf16 with fp32 master weights (4 of 16: ZeRO-Offload's mixed
precision). The estimator (``jzero.max_params`` with the activation and gathered-layer
terms) agrees with each found size within :data:`ESTIMATE_TOLERANCE`.
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
from jzero.accounting.memory_spaces import of_compiled
from jzero.cli.units import parse_bytes


class Entry(NamedTuple):
    """One configuration of the search."""

    name: str
    stage: int
    offload: Any  # None, "optimizer" (streamed), "host" (the host step), or a jzero.Offload
    precision: str = "fp32"  # "fp32", or "bf16": bf16 params and grads, fp32 master weights
    chunk: int | None = None  # Offload(chunk=...) of a streamed offload (None: the default)


ENTRIES = (
    Entry("dp", 0, None),
    Entry("zero1", 1, None),
    Entry("zero2", 2, None),
    Entry("zero3", 3, None),
    # A 64 MB budget is ~1000 x less than a GPU's: the streamed pieces scaled down with it
    # (the default, 2**24 elements, is 2 x 16 MB of Adam state per device at N = 8 here).
    Entry("zero3_offload", 3, "optimizer", chunk=2**20),
    Entry("zero3_host", 3, "host"),
    Entry("zero3_bf16", 3, None, "bf16"),
    Entry("zero3_bf16_host", 3, "host", "bf16"),
)
TARGET = 7.0  # zero3 / dp parameters (theory: N = 8 for model states alone)
# (offloaded, base, parameters ratio at least): the same stage and precision, offload apart
OFFLOAD_TARGETS = (("zero3_host", "zero3", 1.8), ("zero3_bf16_host", "zero3_bf16", 3.5))
OFFLOAD_PARAMS = 1.8  # zero3_offload (streamed) / zero3 parameters, at least
OFFLOAD_TIME = 3.0  # zero3_offload / zero3 step time per token, at most
ESTIMATE_TOLERANCE = 0.10  # |estimate_params / params - 1| of the stage-3 entries
MAX_LAYERS = 100_000
OOM_RETRIES = 4  # device out-of-memory retries of a training, each a few layers lower


class Compiled(NamedTuple):
    """One compiled train step of the family and its memory per device."""

    executable: Any  # jax.stages.Compiled, called with a live state and batch
    peak: int  # device memory: the replayed schedule's peak in device memory
    host: int  # pinned host memory: likewise
    xla_peak: int  # memory_analysis(): argument + output + temp - alias (one memory on CPU)


def family_config(args: argparse.Namespace, layers: int, precision: str = "fp32") -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
        n_heads=args.heads, n_layers=layers, dtype=_DTYPES[precision],
    )  # fmt: skip


_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def family_params(args: argparse.Namespace, layers: int) -> int:
    init_fn = functools.partial(gpt.init_params, family_config(args, layers), jax.random.key(0))
    return gpt.count_params(jax.eval_shape(init_fn))


def _optimizer(entry: Entry, make_tx: Callable[[], optax.GradientTransformation]):
    offload = _offload(entry)
    precision = jzero.Precision(param_dtype=_DTYPES[entry.precision])
    return jzero.ZeroOptimizer(
        make_tx(), jzero.data_mesh(), stage=entry.stage, offload=offload, precision=precision
    )


def compile_step(
    args: argparse.Namespace, *, entry: Entry, layers: int, batch: int, make_tx: Callable,
    grad_accum: int = 1,
) -> Compiled:  # fmt: skip
    """The entry's jzero train step (``manual_gather=True``) of the family's GPT with
    ``layers`` blocks over all devices, compiled from ``ShapeDtypeStruct`` s (the state
    from ``jax.eval_shape`` of ``init_program``, with its planned shardings): nothing runs.
    ``batch`` sequences a step, in ``grad_accum`` micro-batches."""
    cfg = family_config(args, layers, entry.precision)
    opt = _optimizer(entry, make_tx)
    state = jax.eval_shape(*opt.init_program(init_fn=_init_fn(cfg)))
    tokens = jax.ShapeDtypeStruct(
        (batch, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(opt.mesh, P("data"))
    )
    step = opt.train_step(gpt.make_loss_fn(cfg), manual_gather=True, grad_accum=grad_accum)
    executable = step.lower(state, {"tokens": tokens}).compile()
    m = executable.memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    spaces = of_compiled(executable)
    return Compiled(
        executable, spaces["device"], spaces["pinned_host"], int(xla - m.alias_size_in_bytes)
    )


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
    cfg = family_config(args, layers, entry.precision)
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


def _offload_ratios(by_name: dict[str, Any]) -> list[dict[str, Any]]:
    """Each offloaded entry against its base (same stage and precision, only the offload
    differs; at N = 1 also the only meaningful pairs, as stages 0-3 then hold the same
    bytes): the parameters (of the trained models when both trained), the time per token
    (None: not trained), and whether the parameters' target is met."""
    out = []
    for offloaded, base, target in (("zero3_offload", "zero3", OFFLOAD_PARAMS), *OFFLOAD_TARGETS):
        if not {base, offloaded} <= by_name.keys():
            continue
        b, o = by_name[base], by_name[offloaded]
        trained = b["train"] is not None and o["train"] is not None
        params = (o["train"] if trained else o)["params"] / (b["train"] if trained else b)["params"]
        time_ratio = o["train"]["ms_per_token"] / b["train"]["ms_per_token"] if trained else None
        out.append({
            "base": base,
            "offloaded": offloaded,
            "params_ratio": params,
            "ms_per_token_ratio": time_ratio,
            "target_params_ratio": target,
            "target_ms_per_token_ratio": OFFLOAD_TIME,
            "met": params >= target,
        })  # fmt: skip
    return out


def _estimate_check(stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stage-3 entries' estimator errors against the found sizes, and whether each is
    within :data:`ESTIMATE_TOLERANCE`."""
    errors = {s["name"]: s["estimate_error"] for s in stages if s["stage"] == 3}
    if not errors:
        return None
    worst = max(errors, key=lambda k: abs(errors[k]))
    return {
        "tolerance": ESTIMATE_TOLERANCE,
        "errors": errors,
        "worst": worst,
        "met": abs(errors[worst]) <= ESTIMATE_TOLERANCE,
    }


def _offload(entry: Entry) -> jzero.Offload | None:
    """The entry's offload as ``ZeroOptimizer(offload=...)`` takes it."""
    o = entry.offload
    if isinstance(o, str):
        return jzero.Offload(optimizer="host" if o == "host" else "stream", chunk=entry.chunk)
    return o


def _estimated(entry: Entry) -> dict[str, Any]:
    """The entry's offload as the estimator's keyword arguments."""
    o = _offload(entry)
    if o is None:
        return {"offload": None}
    out = {"offload": o.optimizer, "offload_params": o.params}
    return out | ({"offload_chunk": o.chunk} if o.chunk is not None else {})


def _search(args, entry: Entry, *, budget: float, n: int, batch: int, make_tx, family):
    """One entry's search: ``(stage fields, compiled step at the found depth)``."""
    base, per_layer = family["params_base"], family["params_per_layer"]

    def acts(layers: int) -> float:  # Korthikanti et al.'s 16-bit bytes, x2 for fp32
        return (2 if entry.precision == "fp32" else 1) * transformer_activation_bytes(
            batch=max(1, batch // n), seq=args.seq_len, hidden=args.d_model,
            layers=max(1, layers), heads=args.heads, checkpointing=True,
        )  # fmt: skip

    precision = "fp32" if entry.precision == "fp32" else "mixed"
    common = {"devices": n, "stage": entry.stage, "precision": precision, **_estimated(entry)}

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
    # (the estimator's bytes per layer can be off: past offload_chunk elements a stacked
    # leaf streams in chunks, which costs more).
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
        "offload": entry.offload if isinstance(entry.offload, str | None) else str(entry.offload),
        "chunk": entry.chunk,
        "precision": entry.precision,
        "layers": layers,
        "params": base + layers * per_layer,
        "peak_bytes": seen[layers],
        "xla_peak_bytes": compiled[layers].xla_peak,
        "host_bytes": compiled[layers].host,
        "next_layers": layers + 1,
        "next_params": base + (layers + 1) * per_layer,
        "next_peak_bytes": seen[layers + 1],
        "estimate_params": int(full),
        "estimate_error": int(full) / (base + layers * per_layer) - 1,
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
        "dtype": "float32; the _bf16 entries bfloat16 with fp32 master weights",
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
            "estimate_params: jzero.max_params(precision='fp32' or 'mixed' (bf16), "
            "offload=the entry's, largest_layer_params=one block, activation_bytes="
            "transformer_activation_bytes(checkpointing=True) at the found layers, x2 in "
            "fp32); estimate_error: estimate_params / params - 1; "
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
        "estimate_check": _estimate_check(stages),
        "search_seconds": seconds["search"],
    }


CPU_NOTE = "cpu: host memory is the same RAM, so only a GPU can time it"


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
        "run", "layers", "params", "device peak MB", "L+1 MB", "host peak MB", "XLA peak MB",
        "estimate", "est. error",
    )]  # fmt: skip
    for s in mm["stages"]:
        rows.append((
            s["name"], str(s["layers"]), f"{s['params']:,}", f"{s['peak_bytes'] / 1e6:,.2f}",
            f"{s['next_peak_bytes'] / 1e6:,.2f}", f"{s['host_bytes'] / 1e6:,.2f}",
            f"{s['xla_peak_bytes'] / 1e6:,.2f}", f"{s['estimate_params']:,}",
            f"{100 * s['estimate_error']:+.1f}%",
        ))  # fmt: skip
    lines = [head, _table.table(rows, right=set(range(1, 9)))]
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
    for o in mm["offload"]:
        text = (
            f"{o['offloaded']} params / {o['base']} params {o['params_ratio']:.2f} >= "
            f"{o['target_params_ratio']:g}"
        )
        t = o["ms_per_token_ratio"]
        if t is not None:
            text += f" (time per token {t:.2f} x"
            text += f"; {CPU_NOTE})" if platform == "cpu" else ")"
        lines.append(f"{'PASS' if o['met'] else 'FAIL'} {text}")
    if (e := mm["estimate_check"]) is not None:
        verdict = "PASS" if e["met"] else "FAIL"
        worst = f"{100 * e['errors'][e['worst']]:+.1f}% ({e['worst']})"
        lines.append(f"{verdict} stage-3 estimates within {100 * e['tolerance']:g}%: worst {worst}")
    return "\n".join(lines)
