"""``python -m jzero autoconfigure FACTORY ...``: the configuration a model's step fits in,
chosen by :func:`jzero.autoconfigure`, and the table of every candidate.

``FACTORY`` is ``path/to/file.py:function`` (or ``module:function``), a function that
returns the problem as a mapping: ``loss_fn``, ``batch`` (the global batch, arrays or
``jax.ShapeDtypeStruct`` s), ``params`` or ``init_fn``, and optionally ``tx`` (default
``optax.adamw(3e-4)``) and ``config`` (the run's own options). ``--set KEY=VALUE`` passes
keyword arguments to it (numbers are read as numbers), e.g. ``examples/gpt.py:problem
--set d_model=256 --set batch=64``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

FACTORY_HELP = (
    "a function (in FILE.py, or MODULE:FUNCTION) that returns a dict: loss_fn (the loss, as "
    "ZeroOptimizer.train_step takes it), batch (the global batch one step trains on: arrays "
    "or jax.ShapeDtypeStructs), and params (arrays or ShapeDtypeStructs) or init_fn (a "
    "function that makes them); optionally tx (an Optax transformation; default "
    "optax.adamw(3e-4)) and config (a jzero.ZeroConfig of the run's own options, kept in "
    "every candidate)"
)


def add_parser(commands: Any, size: Callable[[str], float]) -> None:
    p = commands.add_parser(
        "autoconfigure",
        help="choose the stage, offload, recompute and micro-batch that fit and run fastest",
        description="Compile every plausible configuration of a model's training step ahead "
        "of time (nothing runs but a short device probe), read its memory, collective bytes "
        "and FLOPs, and choose the one that fits the budget with the lowest predicted time.",
        epilog="Examples: python -m jzero autoconfigure examples/gpt.py:problem --set "
        "d_model=256 --set batch=64 --device-budget 16GB (examples/gpt.py's problem() "
        "returns such a dict). For GPUs that are not here: JAX_PLATFORMS=cpu python -m jzero "
        "autoconfigure examples/llama.py:problem --set size=8b --target h100:8 (Llama 3 8B "
        "on 8 H100s, compiled here for them; pip install 'jzero[gpu-compile]').",
    )
    p.add_argument("factory", metavar="FILE.py:FUNCTION", help=FACTORY_HELP)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument of the factory (repeatable)",
    )
    p.add_argument("--device-budget", type=size, help="device memory per device (default: all)")
    p.add_argument(
        "--host-budget",
        type=size,
        help="pinned host memory: consider offload (the whole state, and about half)",
    )
    p.add_argument(
        "--allow-delay",
        action="store_true",
        help="with --host-budget, also ZeRO-Offload's delayed update (stale by a step)",
    )
    p.add_argument("--stages", default="0,1,2,3", help="the stages to consider (default all)")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="without an accelerator, this many CPU devices (default 8)",
    )
    p.add_argument(
        "--target",
        metavar="GPU:COUNT",
        help="plan for GPUs that are not here, compiled by XLA's GPU compiler (the "
        "gpu-compile extra), spelled as jzero.gpu_mesh spells them: e.g. h100:8 (one host), "
        "h100:64 (hosts of 8) or h200:8x8 (hosts x GPUs); GPUs: a100, b200, h100, h200, "
        "v100. No offload is planned there.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print no progress on stderr (by default: each candidate as it compiles)",
    )


def run(args: argparse.Namespace) -> int:
    import jax

    import jzero

    # Only shapes the CPU backend (harmless with accelerators); before any JAX operation.
    if jax.config.jax_num_cpu_devices != args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    problem = _problem(args.factory, _keywords(args.set))
    where = {"target": args.target} if args.target else {"mesh": jzero.data_mesh()}
    stages = tuple(int(s) for s in args.stages.split(","))
    choice = jzero.autoconfigure(
        problem["loss_fn"],
        problem.get("params"),
        init_fn=problem.get("init_fn"),
        batch=problem["batch"],
        tx=problem.get("tx") or _default_tx(),
        config=problem.get("config"),
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        stages=stages,
        allow_delay=args.allow_delay,
        quiet=args.quiet,
        **where,
    )
    text = f"{choice.table()}\n\n{choice.summary()}"
    print(json.dumps(to_json(choice), indent=2) if args.json else text)
    return 0 if choice.config is not None else 1


def to_json(choice: Any) -> dict:
    """The search as JSON: the choice, the budgets, the device model and every row."""
    row = lambda r: {
        "name": r.name,
        "stage": r.config.stage,
        "offload": r.config.offload.optimizer,
        "recompute": r.config.step.remat_policy is not None,
        "bucket": r.config.comm.bucket,
        "prefetch": r.config.comm.prefetch,
        "grad_accum": r.config.step.grad_accum,
        "micro_batch": r.micro_batch,
        "estimate_bytes": r.estimate_bytes,
        "device_bytes": r.device_bytes,
        "host_bytes": r.host_bytes,
        "collective_bytes": r.collective_bytes,
        "collectives": r.collectives,
        "flops": r.flops,
        "seconds": r.seconds,
        "dropped": r.dropped,
        "compile_seconds": r.compile_seconds,
    }
    chosen = choice.chosen
    return {
        "chosen": None if chosen is None else chosen.name,
        "summary": choice.summary(),
        "device_budget": choice.device_budget,
        "host_budget": choice.host_budget,
        "device_model": choice.device_model._asdict(),
        "search_seconds": choice.search_seconds,
        "compiled": choice.compiled,
        "smallest": None if choice.smallest is None else row(choice.smallest),
        "larger": None if choice.larger is None else row(choice.larger),
        "notes": list(choice.notes),
        "rows": [row(r) for r in choice.rows],
    }


def _default_tx():
    import optax

    return optax.adamw(3e-4)


def _keywords(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {pair!r}: write KEY=VALUE, e.g. --set d_model=256.")
        out[key] = _number(value)
    return out


def _number(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _problem(factory: str, keywords: dict[str, Any]) -> Mapping[str, Any]:
    where, colon, name = factory.rpartition(":")
    if not colon or not where or not name:
        raise ValueError(f"{factory!r}: write FILE.py:FUNCTION or MODULE:FUNCTION.")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"{where}: no such file.")
        name_of_file = "_jzero_factory_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(name_of_file, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name_of_file] = module  # dataclasses look their module up while it runs
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its own imports
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{factory!r}: {where} has no function {name!r}.")
    problem = fn(**keywords)
    missing = {"loss_fn", "batch"} - set(problem)
    if not isinstance(problem, Mapping) or missing or not ({"params", "init_fn"} & set(problem)):
        raise ValueError(
            f"{factory} must return a mapping with loss_fn, batch and params or init_fn "
            f"(and optionally tx, config); got {type(problem).__name__} "
            f"{sorted(problem) if isinstance(problem, Mapping) else ''}."
        )
    return problem
