"""``initialize``: ``jax.distributed.initialize`` with checked arguments and one timeout.

JAX's multi-controller runtime detects a dead or frozen peer through heartbeats: once a
process has sent none for ``heartbeat_timeout_seconds``, the coordination service
terminates every other process (SIGABRT, a C++ stack trace, no word of which step).
Heartbeats go out every half timeout, so that abort comes between half a heartbeat timeout
and a whole one after a peer freezes. :func:`initialize` owns the relation between that
abort and jzero's watchdog (:func:`jzero.distributed.bounded`):
given ``timeout=T`` it records T as the watchdog's default and gives JAX a heartbeat timeout
of ``3 T + 4`` s, so that JAX's earliest abort, ``1.5 T + 2`` s after a freeze, comes at
least ``0.5 T + 2`` s after the watchdog has named the process that stalled and exited.

Arguments left as None come from the environment that ``scripts/launch_local.sh`` sets
(``JZERO_COORDINATOR``, ``JZERO_NUM_PROCESSES``, ``JZERO_PROCESS_ID``), else JAX detects
the cluster itself (SLURM, Open MPI, Kubernetes JobSet, Cloud TPU/GPU).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import operator
import os
from collections.abc import Sequence

import jax

ENV_COORDINATOR = "JZERO_COORDINATOR"
ENV_NUM_PROCESSES = "JZERO_NUM_PROCESSES"
ENV_PROCESS_ID = "JZERO_PROCESS_ID"
ENV_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # read by JAX when no address is given


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts:
    """What :func:`initialize` gave this process, for the watchdog to derive its own."""

    timeout: float
    """Seconds: ``initialize``'s ``timeout``, the default of ``bounded``'s."""
    heartbeat: int
    """Seconds: JAX's ``heartbeat_timeout_seconds``, ``3 * timeout + 4`` rounded up."""

    @property
    def earliest_jax_abort(self) -> float:
        """Seconds after a peer freezes when JAX's heartbeat abort can come, at the
        earliest: the peer's last heartbeat can be half a heartbeat timeout old."""
        return self.heartbeat / 2


_timeouts: Timeouts | None = None  # set by initialize() once jax.distributed is up


def initialized_timeouts() -> Timeouts | None:
    """The timeouts :func:`initialize` set in this process; None before it ran (or when
    ``jax.distributed.initialize`` was called directly)."""
    return _timeouts


def heartbeat_timeout(timeout: float) -> int:
    """JAX's heartbeat timeout for ``initialize(timeout=timeout)``: ``3 timeout + 4`` s,
    whose earliest abort (half of it) leaves the watchdog ``0.5 timeout + 2`` s."""
    return math.ceil(3 * timeout) + 4


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer.") from None


def _bad_address(source: str, address: object, problem: str) -> ValueError:
    return ValueError(
        f"{source} {address!r}: {problem}. Give process 0's host and a free TCP port as "
        "'host:port', e.g. '10.0.0.1:1234', '127.0.0.1:1234' (one machine) or "
        "'[::1]:1234' (IPv6 in brackets)."
    )


def check_coordinator_address(address: object, source: str = "coordinator_address") -> str:
    """``address`` if it is ``host:port`` (IPv6 as ``[addr]:port``) with a port in 1-65535,
    else a ``ValueError`` naming ``source`` (the argument or environment variable)."""
    if not isinstance(address, str):
        raise _bad_address(source, address, f"must be a str, not {type(address).__name__}")
    if not address or address != address.strip() or " " in address:
        raise _bad_address(source, address, "is empty or contains spaces")
    if "://" in address:
        raise _bad_address(source, address, "has a URL scheme; drop it")
    host, colon, port = address.rpartition(":")
    if not colon:
        raise _bad_address(source, address, "has no port")
    if host.startswith("[") != host.endswith("]"):
        raise _bad_address(source, address, "has an unclosed '[' or ']' around the host")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1].split("%")[0])
        except ValueError:
            raise _bad_address(source, address, "has no IPv6 address in brackets") from None
    elif ":" in host:
        raise _bad_address(source, address, "is an IPv6 address without brackets")
    if not host:
        raise _bad_address(source, address, "has no host")
    if not (port.isascii() and port.isdigit()):
        raise _bad_address(source, address, f"port {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise _bad_address(source, address, f"port {int(port)} is outside 1-65535")
    return address


def _check_index(name: str, value: object, source: str) -> int:
    if isinstance(value, bool):  # an int subclass, but never a process count or index
        raise TypeError(f"{name} is {value!r} ({source}); pass an int.")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} is {value!r}, a {type(value).__name__} ({source}); pass an int, "
            f"e.g. {name}=int(os.environ[...])."
        ) from None


def resolve_arguments(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> tuple[str | None, int | None, int | None]:
    """``initialize``'s arguments, or the environment's values for those left None, checked:
    the address (see :func:`check_coordinator_address`), and ints for the process count and
    index (numpy integers become ints)."""
    if coordinator_address is not None:
        check_coordinator_address(coordinator_address)
    else:
        for env in (ENV_COORDINATOR, ENV_JAX_COORDINATOR):
            if env in os.environ:
                coordinator_address = check_coordinator_address(os.environ[env], f"${env}")
                break
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    else:
        num_processes = _check_index("num_processes", num_processes, "the argument")
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    else:
        process_id = _check_index("process_id", process_id, "the argument")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes is {num_processes}; a run has at least 1 process.")
    if process_id is not None and process_id < 0:
        raise ValueError(f"process_id is {process_id}; processes count from 0.")
    known = num_processes is not None and process_id is not None
    if known and not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id {process_id} is outside 0..{num_processes - 1} "
            f"(num_processes={num_processes}); give each process its own index."
        )
    return coordinator_address, num_processes, process_id


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float = 120.0,
    local_device_ids: Sequence[int] | None = None,
) -> None:
    """Joins this process to a multi-process JAX run, with bounded failure.

    A lost peer ends the run within about ``timeout`` seconds of its last step, with a
    message from jzero naming it, in a loop under :func:`jzero.distributed.bounded` (whose
    timeout defaults to this one). JAX's own heartbeat abort, the backstop outside such a
    loop, gets a heartbeat timeout of ``3 timeout + 4`` s: it can come as early as
    ``1.5 timeout + 2`` s after a peer freezes, and no earlier, so the watchdog speaks
    first. Outside ``bounded``, a lost peer ends the run by JAX's abort within
    ``1.5 timeout + 2`` to ``3 timeout + 4`` s.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator (every process passes
            the same; IPv6 as ``[addr]:port``). None: ``$JZERO_COORDINATOR``, else JAX's
            ``$JAX_COORDINATOR_ADDRESS`` or cluster auto-detection.
        num_processes: how many processes take part. None: ``$JZERO_NUM_PROCESSES``, else
            auto-detected.
        process_id: this process's index, 0 to ``num_processes - 1``. None:
            ``$JZERO_PROCESS_ID``, else auto-detected.
        timeout: seconds (at least 1): the watchdog's default timeout; how long processes
            wait for each other to start (``initialization_timeout``) and to shut down
            (``shutdown_timeout_seconds``). JAX's ``heartbeat_timeout_seconds`` is
            ``3 timeout + 4`` (see above).
        local_device_ids: the local devices this process uses (default: all).

    Raises:
        ValueError: an address that is not ``host:port`` with a port in 1-65535, a
            ``process_id`` outside ``0..num_processes - 1``, a ``timeout`` below 1 s.
        TypeError: a ``num_processes`` or ``process_id`` that is not an int.

    Examples:
        >>> jzero.distributed.initialize(timeout=60)  # doctest: +SKIP
        >>> mesh = jzero.data_mesh()  # every device of every process
    """
    global _timeouts
    valid = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if not (valid and math.isfinite(timeout) and timeout >= 1):
        raise ValueError(f"timeout must be a number of seconds >= 1, got {timeout!r}.")
    address, num_processes, process_id = resolve_arguments(
        coordinator_address, num_processes, process_id
    )
    timeouts = Timeouts(timeout=float(timeout), heartbeat=heartbeat_timeout(timeout))
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=math.ceil(timeout),
        heartbeat_timeout_seconds=timeouts.heartbeat,
        shutdown_timeout_seconds=math.ceil(timeout),
    )
    _timeouts = timeouts


def is_main_process() -> bool:
    """Whether this is process 0, the one that logs, plots and writes single files."""
    return jax.process_index() == 0
