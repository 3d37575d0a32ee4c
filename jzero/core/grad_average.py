"""The gradient's dtypes through a step, and its average: one formula for every updater.

Gradients are reduced in ``Precision.reduce_dtype`` and averaged (and summed over
micro-batches) in fp32. A complex leaf keeps its imaginary part: it is reduced and averaged
in the complex dtype of that precision (complex64 for fp32 or a 16-bit one), as Optax
updates complex parameters with complex gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .leaf_layout import LeafLayout, unpad


def dtype_for(grad: Any, real: Any) -> Any:
    """The dtype ``grad`` is carried in where real gradients are carried in ``real``: that,
    or, for a complex gradient, the complex dtype that holds it."""
    if jnp.issubdtype(grad.dtype, jnp.complexfloating):
        return jnp.result_type(real, jnp.complex64)
    return jnp.dtype(real)


def averaged(summed: jax.Array, denominator: jax.Array, layout: LeafLayout) -> jax.Array:
    """A reduced gradient shard (the sum over devices and micro-batches, padded) as the
    updaters read it: in fp32 (complex64), divided by ``denominator``, padding cut off."""
    return unpad(summed.astype(dtype_for(summed, jnp.float32)) / denominator, layout)
