"""Moving a tree between its replicated and its sharded layout inside ``shard_map``.

Written out rather than left to ``with_sharding_constraint``: the compiler's sharding
propagation otherwise carries the shards' layout from the update onto the step's own
outputs: AdamW's weight decay, for one, reads the parameters on their shards, and a
stage 1 step's parameters would then rest sharded. A ``shard_map`` is a
boundary propagation does not cross: slicing the local shard moves nothing, and gathering
is the all-gather of ZeRO's stages 1-2.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core.mesh import DATA


def _data_dim(spec: P) -> int | None:
    for dim, axes in enumerate(spec):
        if axes == DATA or (isinstance(axes, tuple) and DATA in axes):
            return dim
    return None


def _gather(x: jax.Array, src: P, dst: P, dim: int, mesh: Mesh) -> jax.Array:
    """Sharded -> replicated over 'data' (every device gathers the same whole)."""
    body = lambda s: jax.lax.all_gather(s, DATA, axis=dim, tiled=True)
    return jax.shard_map(body, mesh=mesh, in_specs=src, out_specs=dst, check_vma=False)(x)


def _local_shard(x: jax.Array, src: P, dst: P, dim: int, mesh: Mesh) -> jax.Array:
    """Replicated over 'data' -> each device's own shard (no communication)."""

    def body(full):
        size = full.shape[dim] // mesh.shape[DATA]
        start = jax.lax.axis_index(DATA) * size
        return jax.lax.dynamic_slice_in_dim(full, start, size, axis=dim)

    return jax.shard_map(body, mesh=mesh, in_specs=src, out_specs=dst)(x)


def _all_to_all(x: jax.Array, src: P, dst: P, dims: tuple[int, int], mesh: Mesh) -> jax.Array:
    """Sharded along one dimension -> along another (a mixing leaf's owner layout and
    back): each device sends each other device the block it will hold."""
    body = lambda s: jax.lax.all_to_all(
        s, DATA, split_axis=dims[1], concat_axis=dims[0], tiled=True
    )
    return jax.shard_map(body, mesh=mesh, in_specs=src, out_specs=dst, check_vma=False)(x)


def _move(x: jax.Array, src: P, dst: P, mesh: Mesh) -> jax.Array:
    gather_dim, slice_dim = _data_dim(src), _data_dim(dst)
    if gather_dim == slice_dim:
        return x
    if slice_dim is None:
        return _gather(x, src, dst, gather_dim, mesh)
    if gather_dim is None:
        return _local_shard(x, src, dst, slice_dim, mesh)
    return _all_to_all(x, src, dst, (gather_dim, slice_dim), mesh)


def reshard(tree: Any, src: Any, dst: Any, mesh: Mesh) -> Any:
    """``tree`` (laid out as the spec tree ``src``) laid out as ``dst``: each leaf gathered
    over ``data``, sliced to its shard, or moved by all-to-all from one sharded dimension to
    another, where the two specs differ in ``data`` alone."""
    return jax.tree.map(lambda x, s, d: _move(x, s, d, mesh), tree, src, dst)
