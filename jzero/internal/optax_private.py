"""Optax's private parts that a drop-in for an Optax transformation must recognise.

``optax.tree_map_params`` calls ``init`` with a private placeholder in place of the
parameters (``optax.tree_utils._state_utils._ParamsPlaceholder``, a pytree node with no
leaves) to find which state leaves are shaped like them. A drop-in returns what the
wrapped transformation returns for it.
"""

from __future__ import annotations

from typing import Any


def _placeholder_type() -> type | None:
    try:
        from optax.tree_utils import _state_utils
    except ImportError:
        return None
    return getattr(_state_utils, "_ParamsPlaceholder", None)


def is_params_placeholder(params: Any) -> bool:
    """Whether ``params`` is ``optax.tree_map_params``' placeholder (matched by its class,
    or, where Optax moved it, by its name: a placeholder has no leaves to misread)."""
    kind = _placeholder_type()
    if kind is not None:
        return isinstance(params, kind)
    return type(params).__name__ == "_ParamsPlaceholder"
