"""The GPU check's pieces, each reached by its function, and the presets that run a
subset within one 10-minute command (:mod:`.driver`'s ``--quick`` and
``--offload-speed``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import agreement, offload, timed

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"


class Piece(NamedTuple):
    """One piece of the check and how its process is started."""

    function: Callable  # f(ctx) or, with parts, f(ctx, part, earlier)
    parts: tuple[str, ...] = ()  # each run in its own process; () one process
    cpu_devices: int = 1  # forced CPU devices under --dry-run
    xla_flags: str = ""  # added to XLA_FLAGS on GPU
    summary: Callable | None = None  # f(parts): targets across the parts


PIECES = {
    "n1": Piece(timed.n1),
    "offload": Piece(
        offload.run, parts=("none", "streamed", "host_step", "host_step_params"),
        summary=offload.targets,
    ),
    "prefetch": Piece(timed.prefetch, cpu_devices=8, xla_flags=LHS),
    "quant": Piece(timed.quant, cpu_devices=8),
    "agreement": Piece(agreement.run),
    "offload_fixed": Piece(
        offload.fixed, parts=("none", "host_step", "streamed", "host_delayed", "ratio_half"),
        summary=offload.fixed_targets,
    ),
    "offload_32k": Piece(
        offload.fixed_accum, parts=("none", "host_step", "streamed", "host_delayed",
                                          "ratio_half"),
        summary=offload.accum_targets,
    ),
    "host_rate": Piece(offload.host_rate),
}  # fmt: skip

QUICK = {  # --quick: every claim once, within one 10-minute command; seconds per unit
    ("n1", None): 100,  # 70 s on the H200 (2026-12-01)
    ("agreement", None): 240,  # 16 compiles; 8 of them took 83 s on the H200
    ("offload_fixed", "none"): 45,  # 17 s
    ("offload_fixed", "host_step"): 85,  # 69 s
    ("offload_fixed", "streamed"): 60,  # 37 s
}  # fmt: skip
"""530 s of parts, about 550 s with the machine probe and process starts: under 10 minutes."""

OFFLOAD_SPEED = {  # --offload-speed: P20's section 5 in one 10-minute command (estimates:
    ("offload_32k", "none"): 90,  # a 4 K-token part took 70-85 s on the H200, and a
    ("offload_32k", "host_step"): 100,  # 32 K-token step of none is about 1.6 s)
    ("offload_32k", "host_delayed"): 100,
    ("offload_32k", "streamed"): 100,
    ("offload_32k", "ratio_half"): 90,
    ("host_rate", None): 60,
}  # fmt: skip
"""540 s of parts: ZeRO-Offload's speed at 32 K tokens a step and the host update's rate."""
PRESETS = {"quick": QUICK, "offload_speed": OFFLOAD_SPEED}


def units(only: str | None, preset: str | None = None) -> list[tuple[str, str | None]]:
    """``--only`` (or a preset, ``--quick`` or ``--offload-speed``) as ``(piece, part or
    None)`` in the pieces' order; raises ValueError."""
    every = [(p, part) for p, piece in PIECES.items() for part in piece.parts or (None,)]
    if preset is not None:
        if only is not None:
            flag = "--" + preset.replace("_", "-")
            raise ValueError(f"{flag} runs its own units; leave --only out")
        return list(PRESETS[preset])
    if only is None:
        return every
    wanted = set()
    for item in only.split(","):
        piece, _, part = item.strip().partition(":")
        if piece not in PIECES or (part and part not in PIECES[piece].parts):
            names = [p if q is None else f"{p}:{q}" for p, q in every]
            raise ValueError(f"--only: unknown {item!r}; choose pieces {list(PIECES)} or {names}")
        wanted |= {(p, q) for p, q in every if p == piece and (not part or q == part)}
    return [u for u in every if u in wanted]
