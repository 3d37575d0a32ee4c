"""PRNG keys in the model state: a different stream per device inside the step, one state
outside it.

The model state is replicated, so a key in it (an NNX ``RngStream``'s key, or a key the
user keeps there) is the same on every device, and dropout would draw the same mask on
every device's different rows. Inside the step each typed key leaf is folded with the
device's position along the batch axes (``jax.random.fold_in(key, i)``, ``i`` from
``lax.axis_index``) before the loss sees it. What the loss hands back is made identical
on every device again: a key the loss left as it received it goes back unfolded (NNX
streams keep their key and count their draws), and a key the loss replaced (e.g. with a
``jax.random.split`` of it) is device 0's. Keys stay typed keys; they are never averaged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def for_device(model_state: Any, axes: str | tuple[str, ...]) -> Any:
    """``model_state`` with every key leaf folded with this device's index along ``axes``."""
    if not any(is_key(x) for x in jax.tree.leaves(model_state)):
        return model_state
    i = jax.lax.axis_index(axes)
    return jax.tree.map(lambda x: jax.random.fold_in(x, i) if is_key(x) else x, model_state)


def settle(new: Any, *, seen: Any, given: Any, axes: str | tuple[str, ...]) -> Any:
    """The loss's new model state with every key identical on every device.

    ``seen`` is the state the loss received (keys folded), ``given`` the state before
    folding: a key leaf of ``new`` that is the very array the loss received becomes the
    unfolded one; any other key that varies over ``axes`` becomes device 0's.
    """
    leaves, treedef = jax.tree.flatten(new)
    if not any(is_key(x) for x in leaves):
        return new
    if jax.tree.structure(seen) == treedef:
        back = {id(s): g for s, g in zip(jax.tree.leaves(seen), jax.tree.leaves(given))}
        leaves = [back.get(id(x), x) if is_key(x) else x for x in leaves]
    return treedef.unflatten([agree(x, axes) if is_key(x) else x for x in leaves])


def agree(key: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``key`` if it is the same on every device (invariant over ``axes``), else device 0's:
    its data, zero elsewhere, summed over ``axes`` (exact for uint32)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if not set(names) & jax.typeof(key).mat.varying:
        return key
    data = jax.random.key_data(key)
    first = jnp.where(jax.lax.axis_index(axes) == 0, data, jnp.zeros_like(data))
    return jax.random.wrap_key_data(jax.lax.psum(first, axes), impl=jax.random.key_impl(key))
