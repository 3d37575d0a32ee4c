"""``initialize``: ``jax.distributed.initialize`` with every timeout from one value.

JAX's multi-controller runtime detects a dead or frozen peer through heartbeats: after
``heartbeat_timeout_seconds`` without one, the coordination service terminates every
surviving process (SIGABRT, exit status 134, "the JAX distributed service detected fatal
errors"). Its default is 100 s, and a process that never starts is waited for
``initialization_timeout`` (300 s). :func:`initialize` sets all three timeouts from one
``timeout``, so a run with a lost peer ends within that bound; :func:`jzero.distributed.
bounded` makes the survivors say why, first.

Arguments left as None come from the environment that ``scripts/launch_local.sh`` sets
(``JZERO_COORDINATOR``, ``JZERO_NUM_PROCESSES``, ``JZERO_PROCESS_ID``), else JAX detects
the cluster itself (SLURM, Open MPI, Kubernetes JobSet, Cloud TPU/GPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

ENV_COORDINATOR = "JZERO_COORDINATOR"
ENV_NUM_PROCESSES = "JZERO_NUM_PROCESSES"
ENV_PROCESS_ID = "JZERO_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer.") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float = 120.0,
    local_device_ids: Sequence[int] | None = None,
) -> None:
    """Joins this process to a multi-process JAX run, with bounded failure.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator (every process passes
            the same). None: ``$JZERO_COORDINATOR``, else JAX's cluster auto-detection.
        num_processes: how many processes take part. None: ``$JZERO_NUM_PROCESSES``, else
            auto-detected.
        process_id: this process's index, 0 to ``num_processes - 1``. None:
            ``$JZERO_PROCESS_ID``, else auto-detected.
        timeout: seconds, for all three of JAX's timeouts: how long processes wait for
            each other to start (``initialization_timeout``), how long a peer may miss
            heartbeats before every survivor is terminated (``heartbeat_timeout_seconds``),
            and how long shutdown waits for the others (``shutdown_timeout_seconds``).
        local_device_ids: the local devices this process uses (default: all).

    Examples:
        >>> jzero.distributed.initialize(timeout=60)  # under srun, or launch_local.sh
        >>> mesh = jzero.data_mesh()  # every device of every process
    """
    if not (isinstance(timeout, int | float) and timeout >= 1):
        raise ValueError(f"timeout must be a number of seconds >= 1, got {timeout!r}.")
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    known = num_processes is not None and process_id is not None
    if known and not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id {process_id} is outside 0..{num_processes - 1} "
            f"(num_processes={num_processes}); give each process its own index."
        )
    seconds = int(round(timeout))
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=seconds,
        heartbeat_timeout_seconds=seconds,
        shutdown_timeout_seconds=seconds,
    )


def is_main_process() -> bool:
    """Whether this is process 0, the one that logs, plots and writes single files."""
    return jax.process_index() == 0
