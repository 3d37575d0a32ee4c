"""The search's progress on stderr (``jzero.autoconfig.progress``): lines off a terminal, a
bar on one, nothing with ``quiet``. A search's own lines are checked where it runs
(``test_autoconfigure.py`` on the CPU, ``test_target.py`` for GPUs, ``tests/cli``)."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import sys
import termios

import pytest

from jzero.autoconfig.progress import SearchProgress

SECONDS = r"\(\d+ s so far\)"


class Terminal(io.StringIO):
    """What a terminal's stderr says of itself, writing to a string."""

    def isatty(self) -> bool:
        return True


def _search(progress: SearchProgress) -> None:
    """A search's calls: the first lines, 2 planned, 3 compiled (one more found), the end."""
    progress.say("planning for 8 x cpu")
    progress.say("none skipped")
    progress.plan(2)
    for name in ("zero1 accum=1", "zero2 accum=1", "zero2 accum=2"):
        progress.compiling(name)
    progress.done("3 compiled")


def test_off_a_terminal_a_line_per_candidate_nothing_redrawn():
    stream = io.StringIO()
    with SearchProgress(stream=stream) as progress:
        _search(progress)
    lines = stream.getvalue().splitlines()
    patterns = [
        "planning for 8 x cpu",
        "none skipped",
        f"compiling 1 of 2: zero1 accum=1 {SECONDS}",
        f"compiling 2 of 2: zero2 accum=1 {SECONDS}",
        f"compiling 3 of 3: zero2 accum=2 {SECONDS}",  # n grows as the search finds more
        "3 compiled",
    ]
    assert len(lines) == len(patterns)
    for line, pattern in zip(lines, patterns):
        assert re.fullmatch(f"jzero.autoconfigure: {pattern}", line), line
    assert "\r" not in stream.getvalue()


def test_on_a_terminal_a_bar_with_the_lines_above_it():
    pytest.importorskip("tqdm")
    stream = Terminal()
    progress = SearchProgress(stream=stream)
    with progress:
        _search(progress)
    text = stream.getvalue()
    assert "\r" in text  # redrawn in place
    for name, i in (("zero1 accum=1", 1), ("zero2 accum=1", 2)):
        assert re.search(f"jzero.autoconfigure: compiling {i} of 2: {name} {SECONDS}", text)
    assert re.search(f"compiling 3 of 3: zero2 accum=2 {SECONDS}", text)
    lines = [line.rpartition("\r")[2] for line in text.splitlines()]  # as the terminal shows
    assert "jzero.autoconfigure: planning for 8 x cpu" in lines
    assert lines[-1] == "jzero.autoconfigure: 3 compiled"  # below the bar, left full
    full = f"jzero.autoconfigure: compiling 3 of 3: .* {SECONDS} \\|[#█]+\\|"
    assert re.fullmatch(full, lines[-2])
    assert not progress._ticker.is_alive()  # the bar's clock stopped with the search


def _pty_output(rows: int, columns: int) -> str:
    """What a search's progress writes to a real pseudo-terminal of that size."""
    main, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    with os.fdopen(terminal, "w") as stream, SearchProgress(stream=stream) as progress:
        _search(progress)
    out = b""
    while select.select([main], [], [], 0)[0]:
        try:
            out += os.read(main, 1 << 16)
        except OSError:  # EIO: every byte read, and the terminal's side closed
            break
    os.close(main)
    return out.decode().replace("\r\n", "\n")


def test_a_real_terminal_gets_the_bar_and_one_of_no_size_the_lines():
    """A pseudo-terminal of no size (as ``script`` makes without a terminal) would show
    tqdm's bar blank: it gets the lines."""
    pytest.importorskip("tqdm")
    sized, sizeless = _pty_output(24, 100), _pty_output(0, 0)
    assert "\r" in sized and re.search(f"compiling 2 of 2: zero2 accum=1 {SECONDS}", sized)
    assert "\r" not in sizeless and len(sizeless.splitlines()) == 6


def test_on_a_terminal_without_tqdm_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    stream = Terminal()
    with SearchProgress(stream=stream) as progress:
        _search(progress)
    assert len(stream.getvalue().splitlines()) == 6 and "\r" not in stream.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["pipe", "terminal"])
def test_quiet_says_nothing(stream):
    with SearchProgress(quiet=True, stream=stream) as progress:
        _search(progress)
    assert stream.getvalue() == "" and progress.started == 3
