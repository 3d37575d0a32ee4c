"""What :func:`jzero.autoconfigure` is doing, on stderr, while it searches: the devices it
plans for, the candidates the estimator skipped and why (one line), then each candidate as
it compiles (i of n, its name, the seconds so far; n grows when a candidate needs another
micro-batch size or its variants are tried).

Drawn as the main job (``examples/train_lm.py``) draws its training: on a terminal, a tqdm
bar, redrawn each second so that its clock shows a long compile is alive; off one (a log
file, CI) no redraws, a line per candidate. Without tqdm (the ``examples`` extra), or on a
terminal of no size, the lines too. ``quiet=True`` prints nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

PREFIX = "jzero.autoconfigure"
TICK_S = 1.0  # a terminal's bar is redrawn this often, its clock with it


class SearchProgress:
    """The search's progress on ``stream`` (default: ``sys.stderr`` when made); use it as
    a context manager, which closes the bar however the search ends."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None):
        self.quiet = quiet
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.started = 0  # candidates whose compile has started
        self.total = 0  # candidates planned so far
        self._name = ""  # the candidate compiling
        self._bar: Any = None  # tqdm's, on a terminal
        self._stop = threading.Event()  # set: the bar's clock stops
        self._ticker = threading.Thread(target=self._tick, name="jzero-progress", daemon=True)

    def __enter__(self) -> SearchProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def seconds(self) -> float:
        """Seconds since the search started."""
        return time.perf_counter() - self.start

    def say(self, line: str) -> None:
        """A line of its own (above the bar, on a terminal)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(f"{PREFIX}: {line}", file=self.stream)
        else:
            print(f"{PREFIX}: {line}", file=self.stream, flush=True)

    def plan(self, more: int) -> None:
        """``more`` candidates join those to compile."""
        self.total += more

    def compiling(self, name: str) -> None:
        """Candidate ``name`` starts compiling."""
        self.started += 1
        self.total = max(self.total, self.started)
        self._name = name
        if self.quiet:
            return
        if self._bar is None and _draws(self.stream):
            self._bar = _terminal_bar(self.stream)
            if self._bar is not None:
                self._ticker.start()
        if self._bar is None:
            self.say(self._compiling())
            return
        self._bar.total, self._bar.n = self.total, self.started - 1
        self._bar.set_description_str(f"{PREFIX}: {self._compiling()}", refresh=True)

    def done(self, line: str) -> None:
        """The search ended: the bar is left, full, and ``line`` said below it."""
        self.close()
        self.say(line)

    def close(self) -> None:
        """Stops the bar's clock and leaves the bar, at every candidate compiled."""
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        if self._bar is not None:
            self._bar.n = self._bar.total
            self._bar.close()
            self._bar = None

    def _compiling(self) -> str:
        return (
            f"compiling {self.started} of {self.total}: {self._name} "
            f"({self.seconds():.0f} s so far)"
        )

    def _tick(self) -> None:
        """Redraws the bar every :data:`TICK_S`, its seconds so far with it."""
        while not self._stop.wait(TICK_S):
            bar = self._bar
            if bar is not None:
                bar.set_description_str(f"{PREFIX}: {self._compiling()}", refresh=True)


def _draws(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal a bar can be drawn on: one of some size (a
    pseudo-terminal of none, as ``script`` makes without a terminal, shows tqdm's bar
    blank)."""
    if not stream.isatty():
        return False
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):  # no file descriptor: a terminal that says nothing more
        return True
    return size.columns > 0 and size.lines > 0


def _terminal_bar(stream: TextIO) -> Any:
    """tqdm's bar on ``stream``; None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # not a dependency of jzero's: lines, as off a terminal
        return None
    return tqdm(total=0, file=stream, dynamic_ncols=True, bar_format="{desc} |{bar:16}|")
