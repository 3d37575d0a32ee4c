"""A function compiled to run on the host CPU inside a device program (``compute_on``).

The host optimizer step runs each bucket's Optax update as a host computation. JAX spells
that ``jax.experimental.compute_on.compute_on``; jax 0.11.1 changed it from a context
manager / decorator, ``compute_on("device_host")``, to a function wrapper,
``compute_on(f, *, compute_type, out_memory_spaces)``. jzero uses the current form and
checks for it when an optimizer that needs it is built (:func:`unavailable`), so that a
JAX whose ``compute_on`` moved again is refused up front, not deep inside a trace.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

_NEEDED = ("compute_type", "out_memory_spaces")


def _compute_on() -> Any:
    from jax.experimental.compute_on import compute_on

    return compute_on


def unavailable() -> str | None:
    """Why this JAX has no ``compute_on`` of the form jzero uses; None when it has one."""
    try:
        compute_on = _compute_on()
        kw = inspect.signature(compute_on).parameters
    except (ImportError, TypeError, ValueError) as e:
        return f"jax.experimental.compute_on.compute_on cannot be read ({e})"
    keyword_only = lambda n: getattr(kw.get(n), "kind", None) is inspect.Parameter.KEYWORD_ONLY
    missing = [n for n in _NEEDED if not keyword_only(n)]
    if missing or "f" not in kw:
        return (
            f"jax.experimental.compute_on.compute_on{inspect.signature(compute_on)} is not "
            "compute_on(f, *, compute_type, out_memory_spaces)"
        )
    return None


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a host computation whose every output rests in host memory."""
    return _compute_on()(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
