"""``bounded``: a training loop whose survivors exit, with a message, when a peer is lost.

When a peer process dies or freezes, the survivors block inside the next collective. JAX's
coordination service terminates them after its heartbeat timeout (see :func:`initialize`)
with its own message; ``bounded`` makes each survivor leave first and say why: a
watchdog thread exits the process (status 1) when no step has finished for ``timeout``
seconds, and an error raised by a step (a failed collective) ends the process the same
way instead of waiting at exit for peers that are gone.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import jax

EXIT_STATUS = 1


def _leave(message: str) -> None:
    sys.stdout.flush()
    print(
        f"jzero: process {jax.process_index()} of {jax.process_count()}: {message}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_STATUS)  # skip atexit: jax.distributed.shutdown would wait for the dead


class Watchdog:
    """Exits the process when :meth:`beat` has not been called for ``timeout`` seconds.

    Armed by the first beat, so compiling the first step is not timed.
    """

    def __init__(self, timeout: float):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        self.timeout = float(timeout)
        self._last: float | None = None
        self._steps = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jzero-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self) -> None:
        """Call once per finished step (after its results are fetched)."""
        self._last = time.monotonic()
        self._steps += 1

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 4)):
            if self._last is not None and time.monotonic() - self._last > self.timeout:
                _leave(
                    f"no training step finished in {self.timeout:g} s (after step "
                    f"{self._steps}): a peer process is dead or frozen, or one step became "
                    "slower than the timeout (raise it). Exiting; restart from the last "
                    "checkpoint."
                )


@contextlib.contextmanager
def bounded(timeout: float) -> Iterator[Watchdog]:
    """A training loop that ends, with a message, within ``timeout`` of a lost peer.

    Call ``.beat()`` on what it yields after each step's results are fetched (e.g. after
    ``float(metrics["loss"])``). Give ``timeout`` a little below the one passed to
    :func:`initialize`, so that jzero's message comes before JAX's own termination. In a
    single-process run an error raised in the loop propagates as usual.

    Examples:
        >>> with jzero.distributed.bounded(timeout=50) as watchdog:  # doctest: +SKIP
        ...     for batch in batches:
        ...         state, metrics = train_step(state, batch)
        ...         loss = float(metrics["loss"])
        ...         watchdog.beat()
    """
    watchdog = Watchdog(timeout).start()
    try:
        yield watchdog
    except Exception as e:
        if jax.process_count() == 1:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        _leave(f"a step failed ({type(e).__name__}: {first}); a peer process is probably lost.")
    finally:
        watchdog.stop()
