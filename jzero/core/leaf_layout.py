"""The sharding plan: how each leaf is laid out along the mesh's ``data`` axis.

A leaf is sharded along one dimension, the *shard dimension*. When that dimension's size
does not divide the data-axis size N, the stored array is padded with zeros at its end up
to a multiple of N; the user never sees the padding (it is sliced off before every Optax
update and every export, and written back as zeros). Leaves with fewer than
``min_shard_size`` elements, and scalars, stay replicated.

The layout depends only on a leaf's shape (and the user's own PartitionSpec, if any), so
optimizer-state leaves get the same layout as the parameters they mirror.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .mesh import DATA, REPLICA

DEFAULT_MIN_SHARD_SIZE = 0
"""By default every leaf but scalars is sharded, as in FSDP2. Raising the threshold keeps
small leaves (LayerNorm scales, biases) replicated, like DeepSpeed's
``stage3_param_persistence_threshold``: fewer, larger collectives for a little memory."""


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Layout of one leaf (static metadata: deliberately not a pytree node)."""

    shape: tuple[int, ...]  # the true, user-visible shape
    dim: int | None  # dimension sharded along 'data'; None: replicated over 'data'
    padded: tuple[int, ...]  # stored shape: `shape` with `dim` padded to a multiple of N
    spec: P  # PartitionSpec of the sharded (stored) array, user axes included
    user_spec: P  # the user's own PartitionSpec (other mesh axes), without 'data'

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    @property
    def pad(self) -> int:
        return 0 if self.dim is None else self.padded[self.dim] - self.shape[self.dim]

    def axis(self, x: Any) -> int:
        """The shard dimension of ``x``: this leaf, or a stack of it (``lax.scan`` over
        layers adds leading axes), counted from the end so leading axes do not shift it."""
        return x.ndim - len(self.shape) + self.dim

    def data_spec(self) -> P:
        """The spec restricted to the ``data`` axis (what ``shard_map`` sees)."""
        if self.dim is None:
            return P()
        return P(*([None] * self.dim + [DATA]))


def _entries(spec: P, ndim: int) -> list[Any]:
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) != ndim:
        raise ValueError(f"PartitionSpec {spec} has more entries than the leaf's {ndim} dims.")
    return entries


def _spec(entries: list[Any]) -> P:
    # Canonical form (no trailing Nones), as JAX reports it back on arrays.
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return P(*entries)


def leaf_layout(
    shape: tuple[int, ...], n: int, *, min_shard_size: int, user_spec: P | None = None
) -> LeafLayout:
    """Chooses the shard dimension of a leaf of ``shape`` on a data axis of size ``n``.

    Rule: among the dimensions the user's spec leaves free, take the first (most major)
    whose size divides ``n``: no padding, and each shard is one contiguous block per
    leading index, so collectives need no transposes (sharding a minor dimension makes
    every gather and reduce-scatter transpose the leaf). If none divides, the largest,
    padded. The leading dimension of a leaf with two or more dimensions is chosen only
    when the user's spec leaves no other dimension free: it may be a stacked-layers axis
    that ``lax.scan`` / ``nn.scan`` iterate over, which must stay whole on every device.
    """
    shape = tuple(int(s) for s in shape)
    user_spec = P() if user_spec is None else user_spec
    entries = _entries(user_spec, len(shape))
    for axis, why in ((DATA, "jzero adds 'data' itself"), (REPLICA, "it replicates over it")):
        if any(e == axis or (isinstance(e, tuple) and axis in e) for e in entries):
            raise ValueError(
                f"a user PartitionSpec {user_spec} names the {axis!r} axis; {why}. Give "
                "specs over your other axes only (e.g. P(None, 'model'))."
            )
    size = 1
    for s in shape:
        size *= s
    free = [d for d, e in enumerate(entries) if e is None and shape[d] > 0]
    free = [d for d in free if d > 0] or free  # the leading dim only as a last resort
    if n == 1 or not shape or size < max(min_shard_size, 1) or not free:
        return LeafLayout(shape, None, shape, _spec(entries), _spec(entries))
    even = [d for d in free if shape[d] % n == 0]
    dim = min(even) if even else max(free, key=lambda d: (shape[d], d))
    padded = list(shape)
    padded[dim] = -(-shape[dim] // n) * n
    entries_sharded = list(entries)
    entries_sharded[dim] = DATA
    return LeafLayout(shape, dim, tuple(padded), _spec(entries_sharded), _spec(entries))


def pad(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Zero-pads ``x`` (true shape, possibly with leading stacked axes) to the stored shape."""
    if not layout.pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[layout.axis(x)] = (0, layout.pad)
    return jnp.pad(x, widths)


def unpad(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Slices the padding off ``x`` (stored shape, possibly with leading stacked axes)."""
    if not layout.pad:
        return x
    return jax.lax.slice_in_dim(x, 0, layout.shape[layout.dim], axis=layout.axis(x))
