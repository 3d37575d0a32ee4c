"""Floating dtypes as users write them: a dtype, its NumPy name, or DeepSpeed's short name.

:func:`float_dtype` reads ``jnp.bfloat16``, ``np.dtype('float16')``, ``'bfloat16'`` and the
short names DeepSpeed configs use (``'bf16'``, ``'fp16'``, ``'fp32'``, any case), and
refuses anything else with a ``ValueError`` that echoes the value exactly as it was passed
and names the fix. :class:`jzero.Precision` and the safetensors export read their dtypes
through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

ALIASES: dict[str, np.dtype] = {
    "bf16": np.dtype(jnp.bfloat16),
    "fp16": np.dtype(jnp.float16),
    "fp32": np.dtype(jnp.float32),
}
"""DeepSpeed's short names (``"bf16": {"enabled": true}``), accepted beside NumPy's names."""


def _parse(value: Any) -> np.dtype | None:
    """``value`` as a NumPy dtype, or None where NumPy reads no dtype from it."""
    if isinstance(value, str) and value.lower() in ALIASES:
        return ALIASES[value.lower()]
    try:
        return np.dtype(value)
    except (TypeError, ValueError):
        return None


def float_dtype(value: Any, *, what: str, allowed: Sequence[np.dtype], example: str) -> np.dtype:
    """``value`` (a dtype, a dtype name, or ``'bf16'`` / ``'fp16'`` / ``'fp32'``) as one of
    the ``allowed`` NumPy dtypes.

    Args:
        value: what the user passed.
        what: what it is for, as the message should name it, e.g. ``"Precision.param_dtype"``.
        allowed: the dtypes accepted, in the order the message lists them.
        example: a correct call, for the message, e.g. ``"Precision(param_dtype=jnp.bfloat16)"``.

    Raises:
        ValueError: ``value`` is no dtype, or one not in ``allowed``; the message shows
            ``value`` as given (and the dtype NumPy read from a name, where it differs).
    """
    dtype = _parse(value)
    if dtype is not None and dtype in allowed:
        return dtype
    names = [d.name for d in allowed]
    listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
    read = ""
    if dtype is not None and isinstance(value, str) and value != dtype.name:
        read = f" (NumPy reads it as {dtype.name})"
    short = ", ".join(repr(a) for a in ALIASES)
    raise ValueError(
        f"{what} must be {listed}, got {value!r}{read}; e.g. {example} (a dtype, its name, "
        f"or one of the short names {short})."
    )
