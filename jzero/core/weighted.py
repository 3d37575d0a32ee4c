"""Token-weighted losses: ``loss_fn`` returns a sum and a count; the step divides globally.

A loss that averages over its own slice (``jnp.mean``) gives every device the same weight,
so with padding or masks the objective depends on how tokens fall across devices and
micro-batches. Returning :class:`Weighted` instead makes the step sum ``total`` and
``count`` over devices and micro-batches first and train on ``sum(total) / sum(count)``:
the single-device objective over the global batch, whatever the split.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Weighted(NamedTuple):
    """A loss as a sum over this device's tokens (or examples) and how many there are.

    Return it from ``loss_fn`` in place of a mean loss (with ``has_aux``: ``(Weighted(...),
    aux)``). jzero sums both fields over devices and micro-batches, differentiates the sum
    and divides the gradients by the global count, so training follows ``total / count``
    of the whole batch exactly; ``metrics['loss']`` is that quotient. ``count`` is not
    differentiated. A global count of 0 is taken as 1 (the loss is then the total, usually
    0, and the gradients are the gradients of the total).

    Examples:
        >>> def loss_fn(params, batch):
        ...     nll_BxT = per_token_nll(params, batch)  # padding included
        ...     mask_BxT = batch["mask"]  # 1 for real tokens, 0 for padding
        ...     return jzero.Weighted(total=(nll_BxT * mask_BxT).sum(), count=mask_BxT.sum())
    """

    total: jax.Array  # () float: the sum of the per-token losses on this device's slice
    count: jax.Array  # () int or float: the number of tokens, or the sum of their weights


def check_weighted(loss: Weighted) -> Weighted:
    """``total`` a float scalar (as float32), ``count`` a real scalar (int32 or float32)."""
    total, count = jnp.asarray(loss.total), jnp.asarray(loss.count)
    if total.shape != () or not jnp.issubdtype(total.dtype, jnp.floating):
        raise TypeError(
            f"jzero.Weighted(total=...) must be a floating-point scalar, got {_describe(total)}; "
            "sum the per-token losses over the device's batch, e.g. (nll * mask).sum()."
        )
    if count.shape != () or not (
        jnp.issubdtype(count.dtype, jnp.integer) or jnp.issubdtype(count.dtype, jnp.floating)
    ):
        raise TypeError(
            f"jzero.Weighted(count=...) must be an integer or float scalar, got "
            f"{_describe(count)}; count the tokens the total sums over, e.g. mask.sum()."
        )
    kind = jnp.int32 if jnp.issubdtype(count.dtype, jnp.integer) else jnp.float32
    return Weighted(total.astype(jnp.float32), jax.lax.stop_gradient(count.astype(kind)))


def divisor(count: jax.Array) -> jax.Array:
    """The global count as float32, with 0 taken as 1."""
    count = count.astype(jnp.float32)
    return jnp.where(count == 0, jnp.float32(1), count)


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"
