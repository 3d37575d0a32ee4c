"""``python -m jzero checkpoint inspect DIR`` and ``... checkpoint export DIR OUT``.

Both read a checkpoint leaf by leaf onto one device, so neither needs the model, the
optimizer or the mesh it was written with, and neither holds more than one leaf.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import jax
import numpy as np

from .._table import table
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.export import write_safetensors
from ..checkpoint.format import CheckpointError
from ..core.checksum import checksums
from .units import format_bytes

_DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "checkpoint",
        help="inspect or export a jzero checkpoint",
        description="Inspect a jzero checkpoint directory, or export its weights to one "
        "safetensors file that plain JAX / Flax / PyTorch can read.",
    )
    sub = p.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="steps, leaves, shapes, dtypes, sizes, checksums")
    inspect.add_argument("directory")
    inspect.add_argument("--step", type=int, help="the step to list (default: the latest)")
    inspect.add_argument("--verify", action="store_true", help="read every leaf, check checksums")
    export = sub.add_parser("export", help="the weights as one .safetensors file")
    export.add_argument("directory")
    export.add_argument("out", metavar="OUT.safetensors")
    export.add_argument("--step", type=int, help="the step to export (default: the latest)")
    export.add_argument("--dtype", choices=sorted(_DTYPES), help="cast (default: as stored)")


def _open(args: argparse.Namespace) -> tuple[Checkpointer, int, dict[str, Any]]:
    if not os.path.isdir(args.directory):
        raise ValueError(f"{args.directory} is not a directory; pass a checkpoint directory.")
    ckpt = Checkpointer(args.directory)
    steps = ckpt.all_steps()
    if not steps:
        raise ValueError(f"no finished checkpoint in {args.directory}.")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise ValueError(f"no checkpoint step {step} in {args.directory}; steps: {steps}.")
    try:
        return ckpt, step, ckpt.metadata(step)
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def _read_leaf(ckpt: Checkpointer, step: int, name: str, info: dict[str, Any]) -> jax.Array:
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("one",))  # jax 0.12.1 deprecates
    device = jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec())  # SingleDevice...
    target = jax.ShapeDtypeStruct(tuple(info["shape"]), np.dtype(info["dtype"]), sharding=device)
    return ckpt.read(step, {name: target})[name]


def inspect(args: argparse.Namespace) -> int:
    ckpt, step, meta = _open(args)
    leaves = meta["leaves"]
    incomplete = sorted(n for n in os.listdir(args.directory) if "tmp" in n)
    size = sum(math.prod(i["shape"]) * np.dtype(i["dtype"]).itemsize for i in leaves.values())
    mesh = ", ".join(f"{k}={v}" for k, v in meta["mesh"].items())
    lines = [
        f"{args.directory}: steps {ckpt.all_steps()}"
        + (f"; incomplete (ignored): {', '.join(incomplete)}" if incomplete else ""),
        f"step {step}: stage {meta['stage']} on {meta['devices']} devices (mesh {mesh}), "
        f"params {'/'.join(meta['param_dtypes'])}"
        + (" with fp32 master weights" if meta["mixed_precision"] else "")
        + f", {len(leaves)} leaves, {format_bytes(size)}",
        f"extra: {json.dumps(meta.get('extra'))}",
    ]
    rows = [("leaf", "shape", "dtype", "bytes", "checksum", "status")]
    bad = 0
    for name, info in leaves.items():
        status = "recorded"
        if args.verify:
            try:
                got = checksums([_read_leaf(ckpt, step, name, info)], [info["shape"]])[0]
                status = "ok" if got == info["checksum"] else f"MISMATCH (read {got})"
            except Exception as e:  # noqa: BLE001 -- any read failure is reported per leaf
                status = f"UNREADABLE ({type(e).__name__})"
            bad += status != "ok"
        nbytes = math.prod(info["shape"]) * np.dtype(info["dtype"]).itemsize
        shape = "[" + ",".join(map(str, info["shape"])) + "]"
        rows.append((name, shape, info["dtype"], f"{nbytes:,}", info["checksum"], status))
    print("\n".join(lines) + "\n" + table(rows, right={3}))
    if args.verify:
        print(
            f"verified {len(leaves) - bad} of {len(leaves)} leaves" + (": CORRUPT" if bad else "")
        )
    return 1 if bad else 0


def export(args: argparse.Namespace) -> int:
    ckpt, step, meta = _open(args)
    weights = {
        n: i for n, i in meta["leaves"].items() if n == "weights" or n.startswith("weights.")
    }
    dtype = None if args.dtype is None else np.dtype(jax.numpy.dtype(_DTYPES[args.dtype]))

    def fetch(name: str, info: dict[str, Any]):
        def read() -> np.ndarray:
            x = _read_leaf(ckpt, step, name, info)
            if checksums([x], [info["shape"]])[0] != info["checksum"]:
                raise ValueError(f"checkpoint step {step}: leaf {name!r} fails its checksum.")
            x = np.asarray(x)
            floating = np.issubdtype(x.dtype, np.floating) or x.dtype == jax.numpy.bfloat16
            return x.astype(dtype) if dtype is not None and floating else x

        return read

    leaves = []
    for name, info in weights.items():
        out_dtype = np.dtype(info["dtype"])
        if dtype is not None and np.issubdtype(out_dtype, np.floating):
            out_dtype = dtype
        tensor = name.removeprefix("weights").removeprefix(".") or "weights"
        leaves.append((tensor, tuple(info["shape"]), out_dtype, fetch(name, info)))
    metadata = {
        "format": "jzero",
        "step": str(step),
        "stage": str(meta["stage"]),
        "devices": str(meta["devices"]),
        "source": "master" if meta["mixed_precision"] else "params",
        "dtype": str(dtype) if dtype is not None else "as stored",
    }
    write_safetensors(args.out, leaves, metadata=metadata)
    print(f"wrote {args.out}: {len(leaves)} tensors from step {step} of {args.directory}")
    return 0


def run(args: argparse.Namespace) -> int:
    return inspect(args) if args.action == "inspect" else export(args)
