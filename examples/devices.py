"""Device and process set-up shared by the examples (the library never touches jax.config).

One process (the default): all accelerators, or ``--cpu-devices`` forced CPU devices.

Several processes (``JZERO_NUM_PROCESSES`` set, e.g. by ``scripts/launch_local.sh N`` or
by hand on a cluster): every process runs the same script; :func:`setup_devices` forces
``JZERO_LOCAL_CPU_DEVICES`` CPU devices in each (``--cpu-devices / N`` when unset; ignored
on GPU/TPU) and calls :func:`jzero.distributed.initialize`, which reads
``JZERO_COORDINATOR`` and ``JZERO_PROCESS_ID`` (JAX's cluster detection, e.g. SLURM, fills
in what is unset) and bounds start-up, heartbeats and shutdown by ``timeout`` seconds.
``jax.devices()`` then lists every device of every process. Feed each step with
:func:`global_batch` (a batch every process drew alike -> each places only its rows), and
print or write files on :func:`jzero.distributed.is_main_process` only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import jzero

ENV_NUM_PROCESSES = "JZERO_NUM_PROCESSES"  # read by jzero.distributed.initialize too
ENV_LOCAL_CPU_DEVICES = "JZERO_LOCAL_CPU_DEVICES"  # set by scripts/launch_local.sh


def multi_process_env() -> int | None:
    """The process count ``$JZERO_NUM_PROCESSES`` asks for, or None (one process)."""
    value = os.environ.get(ENV_NUM_PROCESSES)
    return None if value is None else int(value)


def setup_devices(cpu_devices: int, *, timeout: float = 300.0) -> list[jax.Device]:
    """All accelerators (of every process), or forced CPU devices when there are none.

    ``jax_num_cpu_devices`` only shapes the CPU backend, so setting it is harmless on
    GPU/TPU, where ``jax.devices()`` returns the accelerators. It must happen before any
    JAX operation, and so must :func:`jzero.distributed.initialize` (called here, with
    ``timeout``, when ``$JZERO_NUM_PROCESSES`` is set).
    """
    processes = multi_process_env()
    local = cpu_devices
    if processes is not None:
        local = int(os.environ.get(ENV_LOCAL_CPU_DEVICES, -(-cpu_devices // processes)))
    if jax.config.jax_num_cpu_devices != local:
        jax.config.update("jax_num_cpu_devices", local)
    if processes is not None:
        jzero.distributed.initialize(timeout=timeout)
    return jax.devices()


def sync_processes(name: str) -> None:
    """Waits until every process has called it with ``name`` (nothing on one process): e.g.
    after each has looked at a directory that one of them is about to create."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def process_rows(batch: Any) -> Any:
    """This process's rows of a global batch every process drew alike: the
    ``jax.process_index()``-th of ``jax.process_count()`` equal blocks (all of it on one)."""
    rank, count = jax.process_index(), jax.process_count()

    def rows(x: Any) -> np.ndarray:
        x = np.asarray(x)
        n = x.shape[0] // count
        return x[rank * n : (rank + 1) * n]

    return jax.tree.map(rows, batch)


def global_batch(mesh: jax.sharding.Mesh, batch: Any) -> Any:
    """A global batch (the same numpy values on every process) -> global arrays split over
    ``data``, each process placing only its own rows: the same arrays, and so the same
    training, as one process placing the whole batch."""
    return jzero.distributed.global_batch(mesh, process_rows(batch))


class _NoWatchdog:
    def beat(self) -> None:
        pass


@contextlib.contextmanager
def bounded(timeout: float) -> Iterator[Any]:
    """:func:`jzero.distributed.bounded` with ``timeout`` in a multi-process run (a lost
    peer ends this process with a message); on one process, nothing (no watchdog)."""
    if jax.process_count() == 1:
        yield _NoWatchdog()
        return
    with jzero.distributed.bounded(timeout) as watchdog:
        yield watchdog
