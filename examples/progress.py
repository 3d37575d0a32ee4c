"""How a run went, in words the examples print."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np


def trend(name: str, first: float, last: float) -> str:
    """'NAME fell from A to B' or 'rose', as it happened ('went' when B is not a number)."""
    if last < first:
        verb = "fell"
    elif last > first:
        verb = "rose"
    elif last == first:
        return f"{name} stayed at {first:.4f}"
    else:
        verb = "went"
    return f"{name} {verb} from {first:.4f} to {last:.4f}"


def curve_table(
    losses: list[float], val_losses: list[tuple[int, float]], *, rows: int = 7
) -> list[str]:
    """A few points of the curve, one line each: the step, the training loss (the mean over
    the steps since the previous evaluation; '-' before the first step) and the validation
    loss. About ``rows`` evaluations: every k-th from the first, and the last."""
    k = max(1, math.ceil((len(val_losses) - 1) / (rows - 1)))
    picks = sorted({*range(0, len(val_losses), k), len(val_losses) - 1})
    lines = [f"{'step':>7} {'train':>7} {'val':>7}"]
    for i in picks:
        step, val = val_losses[i]
        since = val_losses[i - 1][0] if i > 0 else 0
        window = losses[since:step]
        train = f"{np.mean(window):7.4f}" if window else f"{'-':>7}"
        lines.append(f"{step:7d} {train} {val:7.4f}")
    return lines


def duration(seconds: float) -> str:
    """'4 min 58 s', or '12.3 s' under a minute."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


class Clock(NamedTuple):
    """A moment on the wall clock and in this process's CPU time (both in seconds)."""

    wall: float  # time.perf_counter()
    cpu: float  # time.process_time(): every thread of this process, user + system

    @classmethod
    def now(cls) -> Clock:
        return cls(time.perf_counter(), time.process_time())

    def elapsed(self) -> Clock:
        """Wall and CPU seconds since this moment."""
        now = Clock.now()
        return Clock(now.wall - self.wall, now.cpu - self.cpu)
