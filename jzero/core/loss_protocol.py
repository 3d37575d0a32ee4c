"""The loss protocol: what ``loss_fn`` may return, checked at trace time with errors that
say how to return it (a float scalar or a :class:`Weighted`; ``(loss, aux)`` with
``has_aux``; ``(loss part, new model state)`` with ``with_model_state``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .weighted import Weighted, check_weighted


def split_model_state(out: Any) -> tuple[Any, Any]:
    """``loss_fn(params, model_state, batch)``'s output -> (loss part, new model state)."""
    if not (isinstance(out, tuple | list) and len(out) == 2) or isinstance(out, Weighted):
        raise TypeError(
            "with with_model_state=True, loss_fn(params, model_state, batch) must return a "
            f"pair (loss, new_model_state), but returned {_describe(out)}; return the state "
            "unchanged if the model has nothing to update (with has_aux=True: "
            "((loss, aux), new_model_state))."
        )
    return out[0], out[1]


def check_loss(out: Any, *, has_aux: bool) -> tuple[Any, Any]:
    """Splits ``loss_fn``'s loss part into (loss, aux) and checks the loss is a float scalar
    or a :class:`Weighted` (sum, count)."""
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2) or isinstance(out, Weighted):
            raise TypeError(
                "with has_aux=True, loss_fn must return a pair (loss, aux), but returned "
                f"{_describe(out)}; return (loss, aux), or build the step without has_aux."
            )
        loss, aux = out
        check_aux(aux)
    else:
        if isinstance(out, tuple | list) and not isinstance(out, Weighted):
            raise TypeError(
                f"loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar loss; if "
                "it returns (loss, aux), build the step with has_aux=True (aux comes back in "
                "metrics['aux'])."
            )
        loss, aux = out, None
    if isinstance(loss, Weighted):
        return check_weighted(loss), aux
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        integer = dtype is not None and not jnp.issubdtype(dtype, jnp.inexact)
        raise TypeError(
            f"the loss must be a floating-point scalar, got {_describe(loss)}; "
            + (
                "an integer loss has zero gradients everywhere: compute it in floating point."
                if integer and shape == ()
                else "reduce it to one number (e.g. jnp.mean) over the device's batch."
            )
        )
    return loss, aux


def check_aux(aux: Any) -> None:
    """Every leaf of ``has_aux``'s aux is a number: an array or a Python scalar of a
    boolean, integer or floating dtype (the step averages or sums it over devices)."""
    for path, x in jax.tree_util.tree_flatten_with_path(aux)[0]:
        if isinstance(x, jax.Array | bool | int | float | complex):
            continue
        if isinstance(x, np.ndarray | np.generic) and x.dtype.kind in "biufc":
            continue
        what = f"the str {x!r:.60}" if isinstance(x, str) else _describe(x)
        raise TypeError(
            f"aux leaf {jax.tree_util.keystr(path)} is {what}; has_aux's aux may hold arrays "
            "and numbers only, which the step averages (floats) or sums (integers) over "
            "devices into metrics['aux']. Return arrays or scalars (e.g. jnp.float32(x)), "
            "and keep strings and other Python objects outside loss_fn (e.g. key the "
            "metrics dict by them)."
        )


def _describe(x: Any) -> str:
    if isinstance(x, Weighted):
        return "a jzero.Weighted alone"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"
