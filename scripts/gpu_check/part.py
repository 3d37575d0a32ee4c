"""One part of the GPU check, in the process the driver (:mod:`.driver`) starts for it.

    python -m gpu_check.part PIECE[:PART] OUT [--dry-run] [--gpus N]
    python -m gpu_check.part machine OUT [--dry-run]

Configures JAX before it starts (CPU under ``--dry-run``, the piece's CPU device count),
runs the part and writes its result, with its seconds and the machine as this process
saw it, to OUT. A part with siblings
reads the results recorded so far for them from OUT (the driver writes them there).
``machine`` writes only the machine's description (the driver's probe; it does not
preallocate GPU memory when started with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from . import common
from .catalog import PIECES, Piece


def configure_jax(piece: Piece | None, *, dry_run: bool) -> None:
    """Before JAX starts: CPU under --dry-run, the CPU device count."""
    if dry_run:
        jax.config.update("jax_platforms", "cpu")
    if piece is None:
        return
    jax.config.update("jax_num_cpu_devices", piece.cpu_devices)


def run(unit: str, out: Path, *, dry_run: bool, gpus: int) -> dict:
    """The part's result (``unit`` is ``piece`` or ``piece:part``)."""
    name, _, part = unit.partition(":")
    piece = PIECES[name]
    ctx = common.Context(dry_run=dry_run, gpu=gpus > 0 and not dry_run)
    start = time.perf_counter()
    if piece.parts:
        earlier = json.loads(out.read_text()) if out.exists() else {}
        result = piece.function(ctx, part, earlier)
    else:
        result = piece.function(ctx)
    return result | {"seconds": time.perf_counter() - start, "machine": common.machine()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("unit", help="piece, piece:part, or 'machine'")
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs present (0: none)")
    args = ap.parse_args()
    piece = None if args.unit == "machine" else PIECES[args.unit.partition(":")[0]]
    configure_jax(piece, dry_run=args.dry_run)
    if piece is None:
        result = common.machine()
    else:
        result = run(args.unit, args.out, dry_run=args.dry_run, gpus=args.gpus)
    args.out.write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
