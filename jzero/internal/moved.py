"""What jzero does when a JAX internal it reads has moved.

Every read of a primitive's parameters, an operand order or a private module goes through
this module's :func:`param` (or raises :class:`InternalMoved` itself), so that a JAX release
that renames a parameter gives one exception type, naming the internal and the JAX
version, instead of a ``KeyError`` deep inside a trace. The features built on the
internals catch it: where a correct fallback exists they take it and :func:`warn_fallback`
once; where none exists they refuse when the optimizer is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax


class InternalMoved(RuntimeError):
    """A JAX internal that jzero reads is not where jzero expects it.

    Attributes:
        internal: what moved, e.g. ``"scan's parameter 'num_consts'"``.
    """

    def __init__(self, internal: str, how: str = "is not where jzero expects it"):
        self.internal = internal
        super().__init__(
            f"JAX {jax.__version__}: the internal {internal} {how}. jzero/internal/README.md "
            "lists every internal jzero reads; please report this with your JAX version."
        )


class InternalMovedWarning(UserWarning):
    """A feature fell back because a JAX internal it reads moved (see :class:`InternalMoved`)."""


_WARNED: set[tuple[str, str]] = set()


def param(params: Mapping[str, Any], name: str, primitive: str) -> Any:
    """``params[name]``, or :class:`InternalMoved` naming the primitive's parameter."""
    try:
        return params[name]
    except KeyError:
        raise InternalMoved(
            f"{primitive}'s parameter {name!r}", f"is gone (it has {sorted(params)})"
        ) from None


def refusal(feature: str, moved: InternalMoved, fix: str) -> RuntimeError:
    """The error for ``feature``, which has no exact fallback for the internal that moved."""
    return RuntimeError(
        f"{feature} needs jzero's jaxpr interpreter, which cannot read JAX "
        f"{jax.__version__}'s {moved.internal}; jzero has no exact way to run it without. "
        f"To go on: {fix}."
    )


def warn_fallback(feature: str, moved: InternalMoved, fallback: str, cost: str) -> None:
    """Warns, once per process for each feature and internal, that ``feature`` fell back.

    Args:
        feature: the jzero feature, e.g. ``"stage 3's per-layer gathering"``.
        moved: the internal that moved.
        fallback: what runs instead, e.g. ``"the whole model is gathered for the step"``.
        cost: what it costs, e.g. ``"about 1.2 MB more per device"``.
    """
    key = (feature, moved.internal)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"{feature}: JAX {jax.__version__} moved the internal {moved.internal}, so "
        f"{fallback}. The step is still exact; it costs {cost}. Pin a JAX release jzero "
        "supports (pyproject.toml) or upgrade jzero to get it back.",
        InternalMovedWarning,
        stacklevel=3,
    )
