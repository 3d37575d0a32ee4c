"""The GPU truth in one command: every jzero claim that needs a GPU, measured, with its
targets marked PASS / FAIL in one JSON.

    bash scripts/gpu_check.sh --quick              # every claim once, under 10 minutes (GPU)
    bash scripts/gpu_check.sh --offload-speed      # P20's offload speed, under 10 minutes
    bash scripts/gpu_check.sh                      # every piece in turn (GPU; tens of minutes)
    bash scripts/gpu_check.sh --only n1            # one piece (each under 10 minutes)
    bash scripts/gpu_check.sh --only offload:none,offload:streamed   # parts of a piece
    bash scripts/gpu_check.sh --dry-run            # CPU, tiny sizes: the code paths (CI)

On a machine lent 10 minutes a command, one piece or part per command (each merges into
the JSON, so the order is free but for offload's ``none`` before its host-step modes):
``--only n1``; ``--only offload:none``; ``--only offload:streamed``; ``--only
offload:host_step``; ``--only offload:host_step_params``; ``--only prefetch``; ``--only
quant``; ``--only agreement``.

``--quick`` is the check for one lease of 15 minutes (one command of at most 10): each
unit with its own time limit (:data:`QUICK`; the H200 took 70, 83, 17, 69 and 37 s on
2026-12-01, agreement then with half its compiles): ``n1`` 100 s, ``agreement`` 240 s,
``offload_fixed:none`` 45 s, ``offload_fixed:host_step`` 85 s and
``offload_fixed:streamed`` 60 s (the 1.21 B GPT of d_model 2048 x 24 layers, no search):
530 s of parts, about 550 s with the machine probe. Then ``--only`` any longer piece in
the time left. ``--offload-speed`` is the same for P20's offload figures in a lease of its
own: ``offload_32k``'s five parts and ``host_rate`` (540 s of parts, estimated).

Pieces (``--only``; a piece with parts runs each part in its own process, and
``piece:part`` picks parts):

- ``n1``: one device, the GPT computing in bf16: step time of stages 0-3 against plain
  ``jax.jit`` + Optax (target <= 1.02 x each; ``scripts/gpu_check/timed.py``).
- ``offload`` (parts ``none``, ``streamed``, ``host_step``, ``host_step_params``): per
  mode, the largest GPT of the family whose step runs and its ms per token; targets: the
  host-step model reaches >= 0.9 x the size the pinned-host limit allows, and at none's
  size its ms per token <= 2 x none's (``scripts/gpu_check/offload.py``). Run ``none`` first.
- ``prefetch``: stage 3 with and without prefetch under
  ``--xla_gpu_enable_latency_hiding_scheduler=true``: step times, and the same loss.
- ``quant``: int8 and fp8 parameter gathers: the quantizer's error against its bound,
  the loss against exact gathers, the step time.
- ``agreement``: the example GPT's jzero step (``scripts/gpu_compile.py``'s model) at
  stages 0-3 compiled on the GPU present (N = 1) and on N compile-only GPUs of its kind
  (``jzero.gpu_mesh``'s spec, described through ``jax.experimental.topologies``): each
  stage's ``memory_analysis()`` (temporaries, arguments, outputs) within 1 % of the real
  compile's, of the real compile's with autotuning off, and with the GPU's autotuning
  results loaded into the compile-only one (``scripts/gpu_check/agreement.py``).
  Compiles only; skipped with the reason when the compile-only GPUs cannot be described
  there.
- ``offload_fixed`` (parts ``none``, ``host_step``, ``streamed``, ``host_delayed``,
  ``ratio_half``): the modes trained at one fixed size, each in its own process: the
  allocator's peak, the compiled device peak (and the replay's) and the step time.
  Targets: the host step's peak <= 0.6 x none's, its step time <= 1.5 x none's; the
  streamed peak below none's by >= 0.8 x the state it offloads, and its step time at
  most none's plus 1.1 x its copies' time (2 x its state over the link, whose bandwidth
  the streamed part measures each way); ``ratio_half``'s
  (``Offload(ratio=0.5)``) peak and time between none's and the host step's; each
  allocator peak within 10 % of its compiled device peak. ``host_delayed``
  (``Offload(delay=1, exact_steps=0)``) is timed beside them; the last two are not in
  ``--quick``: ``--only offload_fixed:host_delayed,offload_fixed:ratio_half`` (about 170 s).
- ``offload_32k`` (the same parts): the same GPT and modes at 8 micro-batches a step (32 K
  tokens, where no offload's step is about 1.6 s): the host step <= 1.3 x none's step
  time, the delayed update <= 1.1 x, streamed <= 2.0 x, ``ratio_half``'s peak and time
  between none's and the host step's. Not in ``--quick``: ``--offload-speed`` runs it
  with ``host_rate`` in one command (:data:`OFFLOAD_SPEED`; its time limits are
  estimates, no GPU has run these parts yet).
- ``host_rate``: the host step's update alone on the GPU's host (2**26 AdamW parameters
  with fp32 master weights, as 1, 8 and 32 leaves: one host computation each) against
  the STREAM triad on every core; target: the best >= 0.7 x the triad. In
  ``--offload-speed``, not in ``--quick``.

Retired: what needs only a compile comes from XLA's GPU compiler without a GPU
(``jzero.gpu_mesh``), in CI. ``mock8`` (whether stage 3's all-gathers overlap compute,
with and without prefetch, on 8 mocked GPUs; Table 2 searched at N = 8) and ``table2``
(Table 2 from the estimator, compiled once per stage) are gone from the check: the
overlap, the collectives and the model states compiled for 8 and 64 H200s are asserted
by ``tests/core/gpu_target/test_compiled_for_gpus.py`` (figures:
``scripts/gpu_compile.py``), Table 2 on compile-only V100s and H200s by
``scripts/table2_gpu.py`` (``benchmarks/table2_gpu.json``). Their figures from the H200's
run stay in ``benchmarks/gpu_check.json``. A lent GPU measures time, offload, and the
agreement of its real compile's memory with the deviceless one (``agreement``).

Each part runs in a fresh process (a GPU's memory is the part's alone; XLA flags must be
set before JAX starts) with a time limit (``--part-seconds``), and its result is merged
into the JSON (``--json``, default benchmarks/gpu_check.json): a
partial run updates its parts and keeps the others, so on a machine lent 10 minutes a
command, run one piece or part per command. ``--dry-run`` runs on CPU at tiny sizes
(8 forced CPU devices where a piece needs N > 1, 1 elsewhere); the agreement targets are
then skipped: CPU memory is not GPU memory. A full run without a GPU is refused.

JSON: ``machine`` (jax version, device kind and count, allocator limit, host memory, XLA
environment), ``dry_run``, ``pieces`` (per piece its result, or its ``parts`` and the
targets across them; every result holds ``targets``: ``{"name", "status": "PASS" | "FAIL",
"text", "measured", "bound"}`` or ``{"name", "status": "SKIP", "reason"}``, beside the raw
figures, and ``ran_at``, ``seconds``, ``machine``), ``summary`` (targets by status, and
errors). Exit status 1 if a part failed to run (its ``error`` says why), else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .catalog import PIECES, PRESETS, Piece, units

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSON = ROOT / "benchmarks" / "gpu_check.json"
DRY_JSON = Path(tempfile.gettempdir()) / "gpu_check_dry.json"
SCRIPTS = ROOT / "scripts"
DRY_NOTE = (
    "dry run: CPU at tiny sizes on a shared machine; its verdicts exercise the code paths, "
    "they are not the GPU's figures"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the code paths")
    ap.add_argument("--only", help="pieces or piece:part, comma-separated (default: all)")
    ap.add_argument(
        "--quick", action="store_true",
        help="every claim once in under 10 minutes: n1, the deviceless compile's memory "
        "against the GPU's (agreement), the host step and the streamed mode against none "
        "at one size",
    )  # fmt: skip
    ap.add_argument(
        "--offload-speed", action="store_true",
        help="P20's offload speed in under 10 minutes: none, the host step, the delayed "
        "update, streamed and ratio 0.5 at 32 K tokens a step, and the host update's rate",
    )  # fmt: skip
    ap.add_argument(
        "--json",
        type=Path,
        help=f"where results merge (default {DEFAULT_JSON.relative_to(ROOT)}; --dry-run: "
        f"{DRY_JSON.name} in the temporary directory)",
    )
    ap.add_argument("--part-seconds", type=float, default=570.0, help="time limit of a part")
    args = ap.parse_args(argv)
    args.json = args.json or (DRY_JSON if args.dry_run else DEFAULT_JSON)
    if args.quick and args.offload_speed:
        ap.error("--quick and --offload-speed are two commands: run one, then the other")
    args.preset = "quick" if args.quick else "offload_speed" if args.offload_speed else None
    try:
        args.units = units(args.only, args.preset)
    except ValueError as e:
        ap.error(str(e))
    return args


# ------------------------------------------------------------------ the driver
def _env(piece: Piece, machine: dict[str, Any]) -> dict[str, str]:
    """The part's environment: XLA flags and, on GPU, a pinned-host limit within RAM."""
    env = _with_scripts(os.environ)
    if machine["platform"] == "gpu":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {piece.xla_flags}".strip()
        host_gib = machine["host_memory_bytes"] / 2**30
        env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(0.75 * host_gib)))
    return env


def _with_scripts(environ) -> dict[str, str]:
    """``environ`` with ``scripts/`` (this package, bench.py) and the checkout on
    ``PYTHONPATH``, for ``python -m gpu_check.part``."""
    path = [str(SCRIPTS), str(ROOT), *filter(None, [environ.get("PYTHONPATH")])]
    return dict(environ, PYTHONPATH=os.pathsep.join(path))


def _process(
    args, unit: str, out: Path, *, env: dict[str, str], gpus: int, seconds: float
) -> str | None:
    """Runs ``--piece unit`` in a fresh process within ``seconds``; None, or why it failed."""
    cmd = [sys.executable, "-m", "gpu_check.part", unit, str(out), "--gpus", str(gpus)]
    cmd += ["--dry-run"] if args.dry_run else []
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as e:
        said = _text(e.stderr)[-2000:] + _text(e.stdout)[-1000:]  # where it was
        return (
            f"timed out after {seconds:.0f} s: run it alone (--only {unit}) or "
            "give it more time (--part-seconds)" + (f"; it had written:\n{said}" if said else "")
        )
    if done.returncode != 0:
        return f"exit status {done.returncode}:\n" + done.stderr[-4000:]
    return None


def _text(output: bytes | str | None) -> str:
    """What a timed-out process had written (bytes, even with ``text=True``)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_unit(args, piece_name: str, part: str | None, doc: dict, machine: dict) -> dict:
    """One part (or a whole piece without parts) in its own process: its result, or
    ``{"error": ..., "targets": []}``."""
    piece = PIECES[piece_name]
    unit = piece_name if part is None else f"{piece_name}:{part}"
    gpus = machine["devices"] if machine["platform"] == "gpu" else 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "part.json"
        if part is not None:  # the piece's other parts, for parts that build on them
            out.write_text(json.dumps(doc["pieces"].get(piece_name, {}).get("parts", {})))
        print(f"{unit}: running ...", flush=True)
        start = time.perf_counter()
        timed = args.preset is not None and not args.dry_run
        seconds = PRESETS[args.preset][piece_name, part] if timed else args.part_seconds
        error = _process(args, unit, out, env=_env(piece, machine), gpus=gpus, seconds=seconds)
        result = {"error": error, "targets": []} if error else json.loads(out.read_text())
    result.setdefault("seconds", time.perf_counter() - start)
    result["ran_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(f"{unit}: {'ERROR' if error else 'done'} in {result['seconds']:.0f} s", flush=True)
    return result


def _merge(doc: dict, piece_name: str, part: str | None, result: dict) -> None:
    """Puts one result into the document; a piece with parts recomputes its targets."""
    piece = PIECES[piece_name]
    if part is None:
        doc["pieces"][piece_name] = result
        return
    entry = doc["pieces"].setdefault(piece_name, {"parts": {}})
    entry["parts"][part] = result
    try:
        entry["targets"] = piece.summary(entry["parts"])
    except Exception:  # a summary that breaks is a result to read, not a lost run
        entry["targets"] = []
        entry["error"] = traceback.format_exc(limit=3)


def _all_results(doc: dict) -> list[dict]:
    found = []
    for entry in doc["pieces"].values():
        found += [entry, *entry.get("parts", {}).values()]
    return found


def summarize(doc: dict) -> dict[str, int]:
    """Targets by status across every piece and part, and the errors."""
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0, "errors": 0}
    for result in _all_results(doc):
        counts["errors"] += bool(result.get("error"))
        for t in result.get("targets", []):
            counts[t["status"]] += 1
    return counts


def _load(path: Path, *, dry_run: bool) -> dict:
    """The JSON so far; a dry run's is replaced by a GPU run's, never the reverse.

    Raises:
        ValueError: a dry run would overwrite GPU results.
    """
    if not path.exists():
        return {"dry_run": dry_run, "pieces": {}}
    doc = json.loads(path.read_text())
    if doc.get("dry_run") is False and dry_run:
        raise ValueError(
            f"{path} holds GPU results; a --dry-run does not overwrite them: give it another "
            "--json PATH (its default is in the temporary directory)."
        )
    if doc.get("dry_run") != dry_run or not isinstance(doc.get("pieces"), dict):
        return {"dry_run": dry_run, "pieces": {}}
    return doc


def report_lines(doc: dict) -> list[str]:
    """One line per target (its status first), per error and per skipped part."""
    lines = []
    for name, entry in doc["pieces"].items():
        named = [(name, entry), *((f"{name}:{p}", r) for p, r in entry.get("parts", {}).items())]
        for unit, result in named:
            if result.get("error"):
                lines.append(f"ERROR {unit}: {result['error'].strip().splitlines()[-1]}")
            if result.get("skipped"):
                lines.append(f"SKIP {unit}: {result['skipped']}")
            for t in result.get("targets", []):
                lines.append(f"{t['status']} {t.get('text') or t['name'] + ': ' + t['reason']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        doc = _load(args.json, dry_run=args.dry_run)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "machine.json"
        env = dict(_with_scripts(os.environ), XLA_PYTHON_CLIENT_PREALLOCATE="false")
        cmd = [sys.executable, "-m", "gpu_check.part", "machine", str(out)]
        subprocess.run(cmd + (["--dry-run"] if args.dry_run else []), env=env, check=True)
        machine = json.loads(out.read_text())
    if machine["platform"] != "gpu" and not args.dry_run:
        print(
            f"gpu_check: no GPU here (JAX's platform is {machine['platform']!r}): the "
            "figures need one. Run with --dry-run for the code paths on CPU at tiny sizes.",
            file=sys.stderr,
        )
        return 2
    doc["machine"] = machine
    if args.dry_run:
        doc["note"] = DRY_NOTE
    failed = False
    for piece_name, part in args.units:
        result = run_unit(args, piece_name, part, doc, machine)
        failed |= bool(result.get("error"))
        _merge(doc, piece_name, part, result)
        doc["summary"] = summarize(doc)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")  # after each part: kept if killed
    print("\n".join(([DRY_NOTE] if args.dry_run else []) + report_lines(doc)))
    print(f"summary: {doc['summary']} -> {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
