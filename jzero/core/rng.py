"""PRNG keys in the model state: a different stream per device inside the step, one state
outside it.

The model state is replicated, so a key in it (an NNX ``RngStream``'s key, or a key the
user keeps there) is the same on every device, and dropout would draw the same mask on
every device's different rows. Inside the step each typed key leaf is folded with the
device's position along the batch axes (``jax.random.fold_in(key, i)``, ``i`` from
``lax.axis_index``) before the loss sees it. A leaf may be a key *array* of any shape,
folded element by element: NNX's scan-over-layers pattern (``nnx.split_rngs`` +
``nnx.vmap``) stores one stream per layer, a key array of shape ``(layers,)``, and each
layer's key is folded on its own (every device and every layer draws its own numbers).

What the loss hands back is made identical on every device again, element by element: a
key the loss left as it received it goes back unfolded (NNX streams keep their key and
count their draws; a stacked key comes back through ``nnx.scan`` as a new array with the
same values, and is recognised by value), and a key the loss replaced (e.g. with a
``jax.random.split`` of it) is device 0's. Keys stay typed keys; they are never averaged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..internal.primitives import varying_axes


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def fold(key: jax.Array, i: jax.Array | int) -> jax.Array:
    """Every element of the key array ``key`` (any shape, ``()`` included) folded with ``i``:
    ``fold(key, i)[j] == jax.random.fold_in(key[j], i)``."""
    flat = key.reshape(-1)
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, i).reshape(key.shape)


def for_device(model_state: Any, axes: str | tuple[str, ...]) -> Any:
    """``model_state`` with every key leaf folded with this device's index along ``axes``."""
    if not any(is_key(x) for x in jax.tree.leaves(model_state)):
        return model_state
    i = jax.lax.axis_index(axes)
    return jax.tree.map(lambda x: fold(x, i) if is_key(x) else x, model_state)


def settle(new: Any, *, seen: Any, given: Any, axes: str | tuple[str, ...]) -> Any:
    """The loss's new model state with every key identical on every device.

    ``seen`` is the state the loss received (keys folded), ``given`` the state before
    folding. Where ``new`` has the structure of ``seen``, each key leaf is compared with the
    one it received at its place (:func:`unfold_kept`): the elements left as received become
    the unfolded ones, the others device 0's. Otherwise a key leaf that is the very array
    the loss received becomes the unfolded one, and any other key device 0's.
    """
    leaves, treedef = jax.tree.flatten(new)
    if not any(is_key(x) for x in leaves):
        return new
    if jax.tree.structure(seen) == treedef:
        triples = zip(leaves, jax.tree.leaves(seen), jax.tree.leaves(given))
        return treedef.unflatten(
            [unfold_kept(x, seen=s, given=g, axes=axes) if is_key(x) else x for x, s, g in triples]
        )
    back = {id(s): g for s, g in zip(jax.tree.leaves(seen), jax.tree.leaves(given))}
    leaves = [back.get(id(x), x) if is_key(x) else x for x in leaves]
    return treedef.unflatten([agree(x, axes) if is_key(x) else x for x in leaves])


def unfold_kept(
    new: jax.Array, *, seen: Any, given: jax.Array, axes: str | tuple[str, ...]
) -> jax.Array:
    """The key array ``new`` that the loss returned where it received ``seen`` (``given``
    folded): ``given``'s element wherever every device returned the element it received,
    else device 0's element of ``new``; the same on every device."""
    if new is seen:
        return given
    if not (is_key(seen) and seen.shape == new.shape and _impl(seen) == _impl(new)):
        return agree(new, axes)
    data, seen_data = jax.random.key_data(new), jax.random.key_data(seen)
    words = tuple(range(new.ndim, data.ndim))  # the axes key_data adds: each key's words
    kept = _everywhere(jnp.all(data == seen_data, axis=words), axes)
    kept = kept.reshape(*new.shape, *(1,) * len(words))
    out = jnp.where(kept, jax.random.key_data(given), jax.random.key_data(agree(new, axes)))
    return jax.random.wrap_key_data(out, impl=_impl(new))


def agree(key: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``key`` (a key array of any shape) if it is the same on every device (invariant over
    ``axes``), else device 0's: its data, zero elsewhere, summed over ``axes`` (exact for
    uint32)."""
    if not _varies(key, axes):
        return key
    data = jax.random.key_data(key)
    first = jnp.where(jax.lax.axis_index(axes) == 0, data, jnp.zeros_like(data))
    return jax.random.wrap_key_data(jax.lax.psum(first, axes), impl=_impl(key))


def _impl(key: jax.Array) -> Any:
    return jax.random.key_impl(key)


def _varies(x: jax.Array, axes: str | tuple[str, ...]) -> bool:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return bool(set(names) & varying_axes(x))


def _everywhere(flags: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """Booleans true where they are true on every device along ``axes``."""
    if not _varies(flags, axes):
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axes).astype(bool)
