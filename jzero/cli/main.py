"""Command line: ``python -m jzero estimate ...``, the memory of ZeRO stages 0-3."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..accounting.estimate import (
    DEFAULT_K,
    STAGE_NAMES,
    STAGES,
    estimate,
    format_params,
    max_params,
    parse_bytes,
    plot_model_states,
    transformer_activation_bytes,
)

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jzero", description="jzero tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "estimate",
        help="per-device memory of ZeRO stages 0-3",
        description="Per-device memory of ZeRO stages 0-3 (GB = 1e9 bytes), or with "
        "--device-memory the largest model that fits.",
    )
    p.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    p.add_argument("--devices", type=int, required=True, help="data-parallel degree N")
    p.add_argument("--stage", type=int, help="one stage, 0-3 (default: all four)")
    p.add_argument("--k", type=float, help="optimizer bytes per param (default 12 mixed, 8 fp32)")
    p.add_argument("--precision", default="mixed", help="mixed (default) or fp32")
    p.add_argument("--model-parallel", type=int, default=1, help="tensor-parallel degree M")
    p.add_argument("--largest-layer", type=float, default=0.0, help="params of largest layer")
    p.add_argument("--prefetch", action="store_true", help="stage 3 gathers two layers at once")
    for flag in _ACTIVATION_FLAGS:
        p.add_argument(f"--{flag}", type=int, help="transformer activations (give all four)")
    p.add_argument("--heads", type=int, help="attention heads (adds the s^2 score term)")
    p.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    p.add_argument("--buffer-bytes", type=float, default=0.0, help="communication buffers")
    p.add_argument("--device-memory", help="answer the inverse: largest model in e.g. 80GB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="plot model states vs N (ZeRO Figure 1)")
    p.add_argument(
        "--measured",
        metavar="BENCH.json",
        help="overlay the model-state bytes that scripts/bench.py --json measured",
    )
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


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(lines)


def _format(result: dict) -> str:
    inp = result["inputs"]
    setting = (
        f"N = {inp['devices']}, K = {inp['k']:g}, {inp['precision']} precision, "
        f"M = {inp['model_parallel']}"
    )
    parts = []
    if "estimates" in result:
        rows = [["stage", "name", *_COLUMNS]]
        for e in result["estimates"]:
            rows.append([str(e["stage"]), STAGE_NAMES[e["stage"]]])
            rows[-1] += [f"{e[key] / 1e9:.2f}" for key in _COLUMNS.values()]
        title = f"Memory per device in GB (1e9 bytes): {format_params(inp['params'])} params, "
        parts.append(title + setting + "\n" + _align(rows))
    if "max_params" in result:
        rows = [["stage", "name", "max params", "total GB"]]
        for m in result["max_params"]:
            total = f"{m['total_bytes'] / 1e9:.2f}"
            rows.append(
                [str(m["stage"]), STAGE_NAMES[m["stage"]], format_params(m["params"]), total]
            )
        memory = inp["device_memory_bytes"] / 1e9
        parts.append(f"Largest model in {memory:g} GB per device: {setting}\n" + _align(rows))
    return "\n\n".join(parts)


def _estimate(args: argparse.Namespace) -> int:
    if args.params is None and args.device_memory is None:
        raise ValueError(
            "nothing to estimate: give --params (memory of that model) and/or "
            "--device-memory (largest model that fits)."
        )
    if args.plot and args.params is None:
        raise ValueError("--plot draws one model: add --params, e.g. --params 7.5e9.")
    common = dict(
        devices=args.devices,
        k=args.k,
        precision=args.precision,
        model_parallel=args.model_parallel,
        largest_layer_params=args.largest_layer,
        prefetch=args.prefetch,
        activation_bytes=_activation_bytes(args),
        buffer_bytes=args.buffer_bytes,
    )
    stages = STAGES if args.stage is None else (args.stage,)
    k = DEFAULT_K.get(args.precision) if args.k is None else args.k
    inputs = {"params": args.params, "device_memory_bytes": None, **common, "k": k}
    result: dict = {"inputs": inputs}
    if args.params is not None:
        estimates = [estimate(params=args.params, stage=s, **common) for s in stages]
        result["estimates"] = [e.to_dict() for e in estimates]
    if args.device_memory is not None:
        inputs["device_memory_bytes"] = memory = parse_bytes(args.device_memory)
        result["max_params"] = []
        for stage in stages:
            psi = max_params(device_memory=memory, stage=stage, **common)
            total = estimate(params=psi, stage=stage, **common).total_bytes if psi else 0.0
            result["max_params"].append({"stage": stage, "params": psi, "total_bytes": total})
    if args.plot:
        opts = {key: common[key] for key in ("k", "precision", "model_parallel")}
        measured = _measured(args.measured) if args.measured else None
        plot_model_states(args.plot, params=args.params, measured=measured, **opts)
        print(f"wrote {args.plot}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else _format(result))
    return 0


def _measured(path: str) -> dict[int, list[tuple[int, float]]]:
    """{stage: [(N, bytes)]} from a benchmark JSON (docs/design.md §5); jzero runs only."""
    try:
        with open(path) as f:
            bench = json.load(f)
        runs, devices = bench["runs"], bench["devices"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"--measured {path}: not a benchmark JSON ({e}); write one with "
            "python scripts/bench.py --json PATH."
        ) from None
    out: dict[int, list[tuple[int, float]]] = {}
    for run in runs:
        if run["name"] in ("dp", "zero1", "zero2", "zero3"):
            out.setdefault(run["stage"], []).append(
                (devices, float(run["model_state_bytes_per_device"]))
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``python -m jzero estimate ...``; returns the exit status (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        return _estimate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
