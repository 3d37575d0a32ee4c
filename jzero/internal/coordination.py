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
from jax._src import distributed as _distributed


def _client() -> Any:
    client = _distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: there is no key-value store.")
    return client


def is_available() -> bool:
    """Whether this process is connected to a coordination service."""
    return _distributed.global_state.client is not None


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
