"""JAX's coordination service key-value store (``jax._src.distributed.global_state.client``).

``jax.distributed.initialize`` starts a coordination service on process 0 and a client in
every process; its key-value store is how jzero's processes see each other's progress
without a collective (a collective is what hangs when a peer freezes). Every call is a
blocking RPC to process 0. The calls release the GIL, but when process 0 is frozen they
wait forever: make them from a thread that can be abandoned.
"""

from __future__ import annotations

from typing import Any

import jax

from .moved import InternalMoved, warn_fallback

try:
    from jax._src import distributed as _distributed
except ImportError:
    _distributed = None

_METHODS = ("key_value_set", "key_value_try_get", "key_value_dir_get")


def _client() -> Any:
    client = _state_client()
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: there is no key-value store.")
    return client


def _state_client() -> Any:
    """JAX's coordination client, None before ``jax.distributed.initialize``."""
    state = getattr(_distributed, "global_state", None)
    if state is None or not hasattr(state, "client"):
        raise InternalMoved("jax._src.distributed.global_state.client")
    client = state.client
    missing = [m for m in _METHODS if client is not None and not hasattr(client, m)]
    if missing:
        raise InternalMoved(f"the coordination client's {missing}")
    return client


def is_available() -> bool:
    """Whether this process is connected to a coordination service whose key-value store
    jzero can use (False, with a warning, where the internals it reads have moved)."""
    try:
        return _state_client() is not None
    except InternalMoved as moved:
        warn_fallback(
            "jzero.distributed.bounded's progress exchange",
            moved,
            "the watchdog still stops a stalled step but cannot name the process that stalled",
            "no memory (only the diagnosis)",
        )
        return False


def put(key: str, value: str) -> None:
    """Sets ``key`` to ``value``, replacing an earlier value."""
    _client().key_value_set(key, value, allow_overwrite=True)


def get(key: str) -> str | None:
    """The value of ``key``, or None when no process has set it."""
    try:
        return _client().key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def entries(directory: str) -> dict[str, str]:
    """Every key under ``directory`` (e.g. ``"jzero/progress"``) and its value."""
    return dict(_client().key_value_dir_get(directory))
