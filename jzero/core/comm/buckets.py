"""Flat collectives: many leaves' shards in one all-gather / reduce-scatter.

DeepSpeed's buckets and FSDP2's parameter groups: a layer's parameters (weights, biases,
norm scales) travel as one flat message instead of one collective per leaf, so a step
issues O(layers) collectives and small leaves stop paying a collective's latency each.

Layout of a bucket: each leaf's shard, its shard dimension moved to the front, flattened,
and the leaves concatenated: one vector per device. ``all_gather`` stacks the N vectors;
leaf i's rows of every device, reshaped, are its N shards in order along the front
dimension, which moves back into place (no copy when the shard dimension is the leading
one, as :func:`jzero.core.leaf_layout.leaf_layout` prefers). Padding is trimmed as in
:func:`jzero.core.comm.collectives.all_gather`. The reduce-scatter is the same picture read
backwards, so both are exact: every element is reduced over the same devices as leaf by
leaf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from ..leaf_layout import LeafLayout, pad
from ..mesh import DATA


def _front(x: jax.Array, axis: int) -> jax.Array:
    return jnp.moveaxis(x, axis, 0)


def all_gather_flat(
    shards: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    *,
    rows_of: Callable[[jax.Array], jax.Array] | None = None,
) -> list:
    """Local shards (one dtype) -> full leaves of the true shapes, in one all-gather.

    ``rows_of``: this device's flat vector -> every device's ``[N, total]``, in place of
    the plain all-gather (:mod:`.quantize` sends it quantized).
    """
    axes = [lay.axis(x) for x, lay in zip(shards, layouts)]
    moved = [_front(x, a) for x, a in zip(shards, axes)]
    flat = jnp.concatenate([m.reshape(-1) for m in moved])
    gather_rows = rows_of or (lambda v: jax.lax.all_gather(v, DATA, axis=0, tiled=False))
    rows = gather_rows(flat)  # [N, total]
    n, out, start = rows.shape[0], [], 0
    for m, a, lay in zip(moved, axes, layouts):
        size = math.prod(m.shape)
        part = rows[:, start : start + size].reshape(n * m.shape[0], *m.shape[1:])
        start += size
        full = jnp.moveaxis(part, 0, a)
        if lay.pad:  # a negative lax.pad, as all_gather trims it (regather_policy spots it)
            config = [(0, 0, 0)] * full.ndim
            config[a] = (0, -lay.pad, 0)
            full = jax.lax.pad(full, jnp.zeros((), full.dtype), config)
        out.append(full)
    return out


def reduce_scatter_flat(
    grads: Sequence[jax.Array],
    layouts: Sequence[LeafLayout],
    *,
    rows_sum: Callable[[jax.Array, list[int]], jax.Array] | None = None,
) -> list:
    """Local full gradients (one dtype) -> this device's shards of their sums over devices,
    in one reduce-scatter.

    ``rows_sum``: every device's ``[N, total]`` (row j: what device j owns) and each
    leaf's elements in a row -> this device's ``[total]`` summed, in place of the plain
    reduce-scatter (:mod:`.quantize` sends it quantized).
    """
    padded = [pad(g, lay) for g, lay in zip(grads, layouts)]
    axes = [lay.axis(g) for g, lay in zip(padded, layouts)]
    moved = [_front(g, a) for g, a in zip(padded, axes)]
    n = jax.lax.axis_size(DATA)
    rows = jnp.concatenate([m.reshape(n, -1) for m in moved], axis=1)  # [N, total]
    if rows_sum is None:
        flat = jax.lax.psum_scatter(rows, DATA, scatter_dimension=0, tiled=False)
    else:
        flat = rows_sum(rows, [math.prod(m.shape) // n for m in moved])
    out, start = [], 0
    for m, a in zip(moved, axes):
        shard_shape = (m.shape[0] // n, *m.shape[1:])
        size = math.prod(shard_shape)
        out.append(jnp.moveaxis(flat[start : start + size].reshape(shard_shape), 0, a))
        start += size
    return out
