"""``bounded``: a training loop whose survivors exit, naming the peer they lost.

When a peer process dies or freezes, the survivors block inside the next collective. JAX's
coordination service terminates them after its heartbeat timeout with a C++ stack trace
and no word of which process or step. ``bounded`` makes each survivor leave first and say
why: a watchdog thread exits the process (status 1) when no step has finished for
``timeout`` seconds, naming the processes that stalled and their last finished step (from
what each process publishes, see :mod:`jzero.distributed.progress`); an error raised by a
step (a failed collective) ends the process the same way instead of waiting at exit for
peers that are gone. A process of a multi-process run that was itself stopped (SIGSTOP, a
debugger) for longer than ``timeout`` says so when it resumes and exits, blaming no peer:
its peers have given up on it. (A single process just carries on.) JAX's own error thread
wakes at the same moment and may print its "Terminating process" line first, or, rarely,
abort before jzero's message: the two race once the process resumes.

Timing, with ``initialize(timeout=T)`` and ``bounded()`` (watchdog timeout T): the
watchdog checks every ``min(1, T/4)`` s and gives the peers' progress as long to arrive,
so it speaks at most ``T + 2 min(1, T/4)`` s after this process's last finished step;
JAX's abort comes no earlier than ``1.5 T + 2`` s after a peer froze (see
:func:`jzero.distributed.initialize`). The last finished step can follow the freeze by
one step's time when the peer froze after its part of that step: steps much shorter than
T keep the order.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import jax

from ..internal import coordination
from .progress import Publisher, stall_report
from .runtime import initialized_timeouts

EXIT_STATUS = 1
MARGIN = 2.0  # seconds the watchdog leaves, at the least, before JAX's earliest abort
_leaving = threading.Lock()  # the first of the watchdog and the loop to leave speaks


def _say(line: str) -> None:
    """Writes ``line`` to stderr in one write: JAX's C++ threads write there too, and a
    line printed in two writes (text, then newline) can take theirs into its middle."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a file (a notebook)
        print(line, end="", file=sys.stderr, flush=True)
        return
    data = line.encode()
    while data:  # one write but for a line longer than the pipe's buffer
        data = data[os.write(fd, data) :]


def _leave(message: str) -> None:
    _leaving.acquire()  # a second caller waits here for the first one's exit
    sys.stdout.flush()
    _say(f"jzero: process {jax.process_index()} of {jax.process_count()}: {message}\n")
    os._exit(EXIT_STATUS)  # skip atexit: jax.distributed.shutdown would wait for the dead


def poll_interval(timeout: float) -> float:
    """Seconds between the watchdog's checks, and the most it waits for peers' progress."""
    return min(1.0, timeout / 4)


def latest_message(timeout: float) -> float:
    """Seconds after the last finished step by which a watchdog with ``timeout`` has spoken:
    the timeout, one polling interval, and the wait for the peers' progress."""
    return timeout + 2 * poll_interval(timeout)


class Watchdog:
    """Exits the process when :meth:`beat` has not been called for ``timeout`` seconds.

    Armed by the first beat, so compiling the first step is not timed.
    """

    def __init__(self, timeout: float):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        self.timeout = float(timeout)
        self.interval = poll_interval(self.timeout)
        self._last: float | None = None  # monotonic time of the last beat
        self._steps = 0  # the last finished step
        self._lock = threading.Lock()  # guards _tick and _stopped
        self._tick = time.monotonic()  # when the watchdog thread last ran
        self._stopped = 0.0  # seconds this process was seen stopped, beyond the timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jzero-watchdog", daemon=True)
        self._publisher: Publisher | None = None
        self._peers = False  # whether other processes wait for this one

    def start(self) -> Watchdog:
        self._peers = jax.process_count() > 1
        if self._peers and coordination.is_available():
            self._publisher = Publisher(
                jax.process_index(), jax.process_count(), lambda: self._steps, self.interval
            ).start()
        with self._lock:
            self._tick = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Call once per finished step (after its results are fetched).

        Args:
            step: the step just finished (e.g. ``int(state.step)``), for the messages;
                default: the beats counted.
        """
        self._steps = self._steps + 1 if step is None else int(step)
        self._last = time.monotonic()
        if self._publisher is not None:
            self._publisher.wake()

    def stop(self) -> None:
        self._done.set()
        if self._publisher is not None:
            self._publisher.stop()

    def stopped_for(self) -> float:
        """Seconds this armed process was stopped (its threads did not run), if longer than
        the timeout, after which its peers' watchdogs give up on it; else 0."""
        with self._lock:
            gap = max(self._stopped, time.monotonic() - self._tick)
        return gap if self._last is not None and gap > self.timeout else 0.0

    def stopped_message(self, seconds: float) -> str:
        return (
            f"this process was stopped (frozen) for {seconds:.1f} s after step {self._steps}, "
            f"longer than the {self.timeout:g} s its peers' watchdogs wait: they have given "
            "up on it; no peer failed. Exiting; restart from the last checkpoint."
        )

    def _stall_message(self) -> str:
        head = f"no training step finished in {self.timeout:g} s (after step {self._steps})"
        if self._publisher is None:
            return (
                f"{head}: a peer process is dead or frozen, or one step became slower than "
                "the timeout (raise it). Exiting; restart from the last checkpoint."
            )
        report = stall_report(
            self._publisher.process,
            jax.process_count(),
            self._steps,
            stale_after=min(self.timeout / 2, 3 * self.interval + 0.5),
            wait=self.interval,
            publisher=self._publisher,
        )
        return f"{head}: {report} Exiting; restart from the last checkpoint."

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            now = time.monotonic()
            with self._lock:
                gap, self._tick = now - self._tick, now
                if self._last is not None and gap > self.timeout:
                    self._stopped = max(self._stopped, gap)
            if self._stopped and self._peers:
                _leave(self.stopped_message(self._stopped))
            if self._stopped:  # no peer gave up on this process: time the step from now
                self._stopped, self._last = 0.0, now
            if self._last is not None and now - self._last > self.timeout:
                _leave(self._stall_message())


def _largest_timeout(room: float) -> float:
    """The largest watchdog timeout whose :func:`latest_message` fits in ``room`` s."""
    return room - 2.0 if room >= latest_message(4.0) else room / 1.5


def watchdog_timeout(timeout: float | None) -> float:
    """``bounded``'s timeout: ``initialize``'s when None; refused when it could let JAX's
    heartbeat abort speak first."""
    timeouts = initialized_timeouts()
    if timeout is None:
        if timeouts is None:
            raise ValueError(
                "bounded() has no timeout: pass timeout=SECONDS, or call "
                "jzero.distributed.initialize(timeout=SECONDS) first (bounded then takes it)."
            )
        return timeouts.timeout
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if timeouts is None:  # jax.distributed set up by hand: its heartbeat is not known
        return float(timeout)
    room = timeouts.earliest_jax_abort - MARGIN
    if latest_message(timeout) > room:
        needed = (2 * (latest_message(timeout) + MARGIN) - 4) / 3
        raise ValueError(
            f"bounded(timeout={timeout:g}) could be too late: "
            f"jzero.distributed.initialize(timeout={timeouts.timeout:g}) gave JAX a "
            f"{timeouts.heartbeat} s heartbeat timeout, whose abort (a C++ stack trace, no "
            f"word of which process stalled) can come {timeouts.earliest_jax_abort:g} s after "
            f"a peer freezes; this watchdog speaks up to {latest_message(timeout):g} s after "
            f"the last step and must leave {MARGIN:g} s. Use bounded(timeout<="
            f"{_largest_timeout(room):.4g}), or bounded() (it takes {timeouts.timeout:g}), or "
            f"initialize(timeout>={needed:.4g})."
        )
    return float(timeout)


@contextlib.contextmanager
def bounded(timeout: float | None = None) -> Iterator[Watchdog]:
    """A training loop that ends, naming the peer it lost, within ``timeout`` of its loss.

    Call ``.beat()`` on what it yields after each step's results are fetched (e.g. after
    ``float(metrics["loss"])``). The survivors of a lost peer exit (status 1) with a
    message naming the processes that stalled and their last finished step; a process
    that was itself frozen for longer than ``timeout`` says so when resumed. In a
    single-process run an error raised in the loop propagates as usual.

    Args:
        timeout: seconds without a finished step before the process exits. None: the one
            given to :func:`jzero.distributed.initialize`, which sets JAX's heartbeat so
            that this watchdog speaks first. A larger one that could let JAX's heartbeat
            abort come first is refused (``ValueError`` with the largest that fits).

    Examples:
        >>> jzero.distributed.initialize(timeout=60)  # doctest: +SKIP
        >>> with jzero.distributed.bounded() as watchdog:  # doctest: +SKIP
        ...     for batch in batches:
        ...         state, metrics = train_step(state, batch)
        ...         loss = float(metrics["loss"])
        ...         watchdog.beat()
    """
    watchdog = Watchdog(watchdog_timeout(timeout)).start()
    try:
        yield watchdog
    except Exception as e:
        if jax.process_count() == 1:
            raise
        stopped = watchdog.stopped_for()
        if stopped:
            _leave(watchdog.stopped_message(stopped))
        first = (str(e).strip().splitlines() or [""])[0][:300]
        _leave(f"a step failed ({type(e).__name__}: {first}); a peer process is probably lost.")
    finally:
        watchdog.stop()
