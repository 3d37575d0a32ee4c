"""Per-leaf checksums, computed on device, that do not depend on the layout.

Orbax stores arrays through tensorstore, which keeps no checksums: flipped bytes in a data
file, or a chunk file that went missing (read back as the fill value, zeros), restore as
wrong values without an error. jzero therefore records two 32-bit sums per leaf at save
time and recomputes them on what a restore read.

The sums run over the leaf's *true* region only (padding masked out) and weight each
element by a function of its position in the true shape, in uint32 arithmetic that wraps.
Integer sums are exact in any order, so the checksum of a leaf is the same whatever its
layout: padded or not, sharded over 8 devices or 3, replicated -- a checkpoint written on
N devices verifies when restored on N'. Any single changed element changes the first sum
(its weight is odd); this detects corruption, it is not a cryptographic hash.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN, _MURMUR, _XXH = 0x9E3779B1, 0x5BD1E995, 0x27D4EB2D


def _words(x: jax.Array) -> jax.Array:
    """The bits of each element as uint32 (8/16-bit types zero-extended)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(np.dtype(x.dtype).itemsize)
    if bits is None:
        raise TypeError(f"cannot checksum {x.dtype}: jzero checkpoints 8/16/32-bit leaves.")
    return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


def leaf_checksum(x: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``uint32[2]`` checksum of ``x``'s region ``[0:shape]`` (``x`` may be padded)."""
    shape = tuple(int(s) for s in shape)
    if x.ndim != len(shape) or any(p < s for p, s in zip(x.shape, shape)):
        raise ValueError(f"a leaf of shape {x.shape} cannot hold the true shape {shape}.")
    index = jnp.zeros(x.shape, jnp.uint32)
    valid = jnp.ones(x.shape, jnp.bool_)
    stride = 1
    for dim in reversed(range(x.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim)
        index = index + iota * jnp.uint32(stride % 2**32)
        valid = valid & (iota < shape[dim])
        stride *= shape[dim]
    words = jnp.where(valid, _words(x), jnp.uint32(0))
    weight1 = index * jnp.uint32(_GOLDEN) | jnp.uint32(1)
    weight2 = (index ^ jnp.uint32(_MURMUR)) * jnp.uint32(_XXH) | jnp.uint32(1)
    mixed = words ^ (words >> 16)
    return jnp.stack([jnp.sum(words * weight1), jnp.sum(mixed * weight2)]).astype(jnp.uint32)


@functools.lru_cache(maxsize=64)
def _program(shapes: tuple[tuple[int, ...], ...]):
    # Leaves in host memory (an offloaded optimizer's) are summed on the device.
    here = lambda x: jax.device_put(x, jax.memory.Space.Device)
    return jax.jit(lambda leaves: [leaf_checksum(here(x), s) for x, s in zip(leaves, shapes)])


def checksums(leaves: Sequence[jax.Array], shapes: Sequence[Sequence[int]]) -> list[str]:
    """One hex string per leaf (``'xxxxxxxx-xxxxxxxx'``), computed in one jitted program."""
    if not leaves:
        return []
    key = tuple(tuple(int(d) for d in s) for s in shapes)
    sums = jax.device_get(_program(key)(list(leaves)))
    return [f"{int(a):08x}-{int(b):08x}" for a, b in sums]
