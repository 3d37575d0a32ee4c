"""Command line: ``python -m jzero estimate ...`` (the memory of ZeRO stages 0-3),
``python -m jzero autoconfigure ...`` (the configuration that fits and runs fastest,
:mod:`.autoconfigure`) and ``python -m jzero checkpoint inspect|export ...``
(:mod:`.checkpoint`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .._table import table
from ..accounting.estimate import (
    DEFAULT_K,
    STAGE_NAMES,
    STAGES,
    estimate,
    max_params,
    transformer_activation_bytes,
)
from .autoconfigure import add_parser as add_autoconfigure_parser
from .autoconfigure import run as run_autoconfigure
from .checkpoint import add_parser as add_checkpoint_parser
from .checkpoint import run as run_checkpoint
from .plot import plot_model_states, read_measured
from .units import format_params, parse_bytes, parse_params

_PROG = "python -m jzero"
_ACTIVATION_FLAGS = ("batch", "seq", "hidden", "layers")
_COLUMNS = {
    "params": "params_bytes",
    "grads": "grads_bytes",
    "optim": "optimizer_bytes",
    "states": "model_state_bytes",
    "gathered": "gathered_layer_bytes",
    "activ": "activation_bytes",
    "buffers": "buffer_bytes",
    "total": "total_bytes",
}


class _BadInput(Exception):
    """A one-line ``prog: error: message`` for `main` to print before returning 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and leave exiting to `main`."""

    def error(self, message: str) -> NoReturn:
        raise _BadInput(f"{self.prog}: error: {message}")


def _converter(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse's ``type=``: its ValueError's message is shown as it is."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_PROG, description="jzero tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "estimate",
        help="per-device memory of ZeRO stages 0-3",
        description="Per-device memory of ZeRO stages 0-3 (GB = 1e9 bytes), or with "
        "--device-memory the largest model that fits. Counts take K/M/B/T suffixes (7.5B), "
        "sizes decimal or binary units (80GB, 80GiB).",
    )
    params = _converter(parse_params)
    p.add_argument("--params", type=params, help="parameter count, e.g. 7.5B or 7.5e9")
    p.add_argument("--devices", type=int, required=True, help="data-parallel degree N")
    p.add_argument("--stage", type=int, help="one stage, 0-3 (default: all four)")
    p.add_argument("--k", type=float, help="optimizer bytes per param (default 12 mixed, 8 fp32)")
    p.add_argument("--precision", default="mixed", help="mixed (default) or fp32")
    p.add_argument("--model-parallel", type=int, default=1, help="tensor-parallel degree M")
    p.add_argument(
        "--shard-group",
        type=int,
        metavar="G",
        help="hybrid sharding (HSDP): shard model states within groups of G devices, "
        "replicate across the N/G groups",
    )
    p.add_argument("--largest-layer", type=params, default=0.0, help="params of largest layer")
    p.add_argument("--prefetch", action="store_true", help="stage 3 gathers two layers at once")
    for flag in _ACTIVATION_FLAGS:
        p.add_argument(f"--{flag}", type=int, help="transformer activations (give all four)")
    p.add_argument("--heads", type=int, help="attention heads (adds the s^2 score term)")
    p.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    size = _converter(parse_bytes)
    p.add_argument("--buffer-bytes", type=size, default=0.0, help="communication buffers")
    p.add_argument("--device-memory", type=size, help="the inverse: largest model in e.g. 80GB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="plot model states vs N (ZeRO Figure 1)")
    p.add_argument(
        "--measured",
        metavar="BENCH.json",
        type=_converter(read_measured),
        help="overlay the model-state bytes that scripts/bench.py --json measured",
    )
    add_autoconfigure_parser(commands, size)
    add_checkpoint_parser(commands)
    return parser


def _activation_bytes(args: argparse.Namespace) -> float:
    given = [flag for flag in _ACTIVATION_FLAGS if getattr(args, flag) is not None]
    if not given:
        return 0.0
    if len(given) < len(_ACTIVATION_FLAGS):
        missing = ", ".join(f"--{f}" for f in _ACTIVATION_FLAGS if f not in given)
        raise ValueError(
            f"activations need --batch, --seq, --hidden and --layers together: add {missing}."
        )
    return transformer_activation_bytes(
        **{flag: getattr(args, flag) for flag in _ACTIVATION_FLAGS},
        heads=args.heads,
        checkpointing=args.checkpointing,
        model_parallel=args.model_parallel,
    )


def _numbers(rows: list[list[str]]) -> str:
    """Every column right-aligned but the stage name (column 1)."""
    return table(rows, right=set(range(len(rows[0]))) - {1})


def _format(result: dict) -> str:
    inp = result["inputs"]
    setting = (
        f"N = {inp['devices']}, K = {inp['k']:g}, {inp['precision']} precision, "
        f"M = {inp['model_parallel']}"
    )
    if inp.get("shard_group") is not None:
        replicas = inp["devices"] // inp["shard_group"]
        setting += f", HSDP: shard group G = {inp['shard_group']} x {replicas} replicas"
    parts = []
    if "estimates" in result:
        rows = [["stage", "name", *_COLUMNS]]
        for e in result["estimates"]:
            rows.append([str(e["stage"]), STAGE_NAMES[e["stage"]]])
            rows[-1] += [f"{e[key] / 1e9:.2f}" for key in _COLUMNS.values()]
        title = f"Memory per device in GB (1e9 bytes): {format_params(inp['params'])} params, "
        parts.append(title + setting + "\n" + _numbers(rows))
    if "max_params" in result:
        rows = [["stage", "name", "max params", "total GB"]]
        for m in result["max_params"]:
            total = f"{m['total_bytes'] / 1e9:.2f}"
            rows.append(
                [str(m["stage"]), STAGE_NAMES[m["stage"]], format_params(m["params"]), total]
            )
        memory = inp["device_memory_bytes"] / 1e9
        parts.append(f"Largest model in {memory:g} GB per device: {setting}\n" + _numbers(rows))
    return "\n\n".join(parts)


def _estimate(args: argparse.Namespace) -> int:
    if args.params is None and args.device_memory is None:
        raise ValueError(
            "nothing to estimate: give --params (memory of that model) and/or "
            "--device-memory (largest model that fits)."
        )
    if args.plot and args.params is None:
        raise ValueError("--plot draws one model: add --params, e.g. --params 7.5B.")
    if args.measured is not None and not args.plot:
        raise ValueError("--measured overlays points on a plot: add --plot FILE.png.")
    if args.plot and args.shard_group is not None:
        raise ValueError(
            "--plot draws model states against N (ZeRO's Figure 1) and takes no "
            "--shard-group; drop one of them."
        )
    common = dict(
        devices=args.devices,
        k=args.k,
        precision=args.precision,
        model_parallel=args.model_parallel,
        largest_layer_params=args.largest_layer,
        prefetch=args.prefetch,
        activation_bytes=_activation_bytes(args),
        buffer_bytes=args.buffer_bytes,
        shard_group=args.shard_group,
    )
    stages = STAGES if args.stage is None else (args.stage,)
    k = DEFAULT_K.get(args.precision) if args.k is None else args.k
    inputs = {"params": args.params, "device_memory_bytes": None, **common, "k": k}
    result: dict = {"inputs": inputs}
    if args.params is not None:
        estimates = [estimate(params=args.params, stage=s, **common) for s in stages]
        result["estimates"] = [e.to_dict() for e in estimates]
    if args.device_memory is not None:
        inputs["device_memory_bytes"] = args.device_memory
        result["max_params"] = []
        for stage in stages:
            psi = max_params(device_memory=args.device_memory, stage=stage, **common)
            total = estimate(params=psi, stage=stage, **common).total_bytes if psi else 0.0
            result["max_params"].append({"stage": stage, "params": psi, "total_bytes": total})
    if args.plot:
        opts = {key: common[key] for key in ("k", "precision", "model_parallel")}
        try:
            plot_model_states(args.plot, params=args.params, measured=args.measured, **opts)
        except OSError as e:
            raise ValueError(
                f"--plot {args.plot}: cannot write it ({e.strerror or e}); give a path in an "
                "existing, writable folder."
            ) from None
        print(f"wrote {args.plot}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else _format(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``python -m jzero estimate|autoconfigure|checkpoint ...``; returns the exit
    status (2 on bad input; 1 when ``checkpoint inspect --verify`` finds a corrupt leaf, or
    when no configuration fits the budget).

    Bad input is reported on stderr as one line, ``python -m jzero COMMAND: error: ...``,
    naming the problem and the fix.
    """
    command = "jzero"
    try:
        args = _parser().parse_args(argv)
        command = args.command
        run = {"checkpoint": run_checkpoint, "autoconfigure": run_autoconfigure}
        return run.get(command, _estimate)(args)
    except _BadInput as e:
        message = str(e)
    except (ValueError, ImportError, OSError) as e:
        message = f"{_PROG} {command}: error: {e}"
    print(message, file=sys.stderr)
    return 2
