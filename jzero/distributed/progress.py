"""Each process's training progress, published where a survivor can read it.

A frozen or dead peer hangs the others inside a collective, where they can learn nothing
about it. So each process's watchdog publishes its last finished step and a wall-clock
time to the coordination service's key-value store (on process 0), from a thread of its
own, after every step and at least once per polling interval; a frozen process stops
publishing. When a survivor's
watchdog fires, :func:`stall_report` reads every entry and names the processes whose
entry went stale or whose step lags. Ages compare wall clocks of different hosts: they
assume clocks synchronized (NTP) to well under half the watchdog's timeout.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ..internal import coordination

DIRECTORY = "jzero/progress"
COORDINATOR = 0  # the process that hosts JAX's coordination service


class Progress(NamedTuple):
    """One process's published progress."""

    step: int  # the last finished step (beats counted, or the step passed to beat())
    time: float  # wall-clock seconds (time.time()) when it was published


def _key(process: int) -> str:
    return f"{DIRECTORY}/{process}"


def _parse(value: str | None) -> Progress | None:
    if value is None:
        return None
    fields = json.loads(value)
    return Progress(int(fields["step"]), float(fields["time"]))


class Publisher:
    """Publishes ``step()`` from a daemon thread, soon after each :meth:`wake` and every
    ``interval`` s regardless, until stopped or until the store fails (process 0 gone).

    Each publication is followed by a read of process 0's entry, all a survivor has to
    report when process 0, and with it the store, is frozen. Publications are at least
    ``0.01 * processes`` s apart, so that the store serves at most about 200 calls a second
    after steps, however many processes and however short the steps; a process that
    freezes within that time (plus one call) of finishing a step is reported one or more
    steps behind.
    """

    def __init__(self, process: int, processes: int, step: Callable[[], int], interval: float):
        self.process = process
        self.coordinator_seen: Progress | None = None
        self._step = step
        self._interval = interval
        self._gap = 0.01 * processes
        self._wake = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jzero-progress", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def wake(self) -> None:
        """A step finished: publish it soon."""
        self._wake.set()

    def stop(self) -> None:
        self._done.set()
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                mine = Progress(self._step(), time.time())
                coordination.put(_key(self.process), json.dumps(mine._asdict()))
                if self.process != COORDINATOR:
                    self.coordinator_seen = _parse(coordination.get(_key(COORDINATOR)))
                self._wake.wait(self._interval)
                self._wake.clear()
                self._done.wait(self._gap)
        except Exception:  # the store is gone (process 0 exited): nothing left to publish to
            return


def _read_all(wait: float) -> dict[int, Progress] | str:
    """Every published entry, or why there are none: the store did not answer in ``wait``
    seconds (``"silent"``) or failed (its error)."""
    result: list[dict[int, Progress] | str] = []

    def read() -> None:
        try:
            entries = coordination.entries(DIRECTORY)
            parsed = {int(k.rpartition("/")[2]): _parse(v) for k, v in entries.items()}
            result.append(parsed)  # type: ignore[arg-type]
        except Exception as e:
            result.append(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")

    threading.Thread(target=read, name="jzero-progress-read", daemon=True).start()
    deadline = time.monotonic() + wait
    while not result and time.monotonic() < deadline:
        time.sleep(0.01)
    return result[0] if result else "silent"


def _describe(process: int, entry: Progress | None, now: float) -> str:
    if entry is None:
        return f"{process} (no step reported)"
    return f"{process} (last finished step {entry.step}, silent for {now - entry.time:.1f} s)"


def stall_report(
    me: int, count: int, my_step: int, *, stale_after: float, wait: float, publisher: Publisher
) -> str:
    """A sentence naming the processes that stalled, from what they published.

    A process stalled when its entry is older than ``stale_after`` seconds (its watchdog
    thread stopped: frozen or dead), or its step is behind the most advanced process's
    (alive but stuck outside the collectives, e.g. loading data)."""
    entries = _read_all(wait)
    now = time.time()
    if entries == "silent":
        if me == COORDINATOR:
            return f"the coordination service did not answer within {wait:g} s."
        seen = _describe(COORDINATOR, publisher.coordinator_seen, now)
        return (
            f"process {seen} hosts JAX's coordination service and did not answer within "
            f"{wait:g} s: it is frozen or dead. This process finished step {my_step}."
        )
    if isinstance(entries, str):
        return f"the other processes' progress could not be read ({entries})."
    entries[me] = Progress(my_step, now)
    newest = max(entry.step for entry in entries.values() if entry is not None)
    stalled = [
        p
        for p in range(count)
        if entries.get(p) is None or now - entries[p].time > stale_after or entries[p].step < newest
    ]
    if not stalled:
        return (
            f"every process reported recently and finished step {newest}: one step became "
            "slower than the timeout (raise it), or a collective is stuck."
        )
    named = ", ".join(_describe(p, entries.get(p), now) for p in stalled[:8])
    more = f" and {len(stalled) - 8} more" if len(stalled) > 8 else ""
    which = "process" if len(stalled) == 1 else "processes"
    return (
        f"{which} {named}{more} stalled: frozen, dead, or stuck outside the collectives. "
        f"This process finished step {my_step}."
    )
