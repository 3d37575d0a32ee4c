"""Which leaves are sharded, and over which of the mesh's other axes: :class:`Layout`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..leaf_layout import DEFAULT_MIN_SHARD_SIZE
from ..param_specs import Rules, as_rules, check_rules
from .moved import names_moved_options


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


@names_moved_options
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Layout:
    """How the parameters are laid out beyond ZeRO's own ``data`` axis.

    Attributes:
        param_specs: optional pytree of ``PartitionSpec`` over the mesh's *other* axes,
            shaped like the parameters (a prefix is fine); jzero adds ``'data'`` to each.
        rules: optional logical axis rules, ``(logical_name, mesh_axes)`` pairs as
            ``nn.logical_axis_rules`` takes them, e.g. ``(('embed', None), ('mlp',
            'model'))``. ``param_specs`` then name logical axes, mapped as Flax maps them
            (:mod:`jzero.core.param_specs`); without ``param_specs``, the parameters' own Flax
            partitioning metadata is mapped.
        min_shard_size: leaves with fewer elements, and scalars, stay replicated (default
            0: every non-scalar leaf is sharded).

    Two layouts are equal when their specs (as a tree), rules and sizes are.
    """

    param_specs: Any = None
    rules: Rules | None = None
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE

    def __post_init__(self):
        size = self.min_shard_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"min_shard_size must be an int, got {size!r}.")
        if size < 0:
            raise ValueError(f"min_shard_size must be >= 0, got {size}.")
        if self.rules is not None:
            object.__setattr__(self, "rules", as_rules(self.rules))
        leaves, treedef = jax.tree.flatten(self.param_specs, is_leaf=_is_spec)
        for leaf in leaves:
            if not _is_spec(leaf):
                raise TypeError(
                    f"param_specs holds {leaf!r} ({type(leaf).__name__}); give a "
                    "jax.sharding.PartitionSpec per parameter leaf (or a prefix of the tree), "
                    "e.g. P(None, 'model')."
                )
        object.__setattr__(self, "_key", (treedef, tuple(leaves), self.rules, size))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def check(self, mesh: Mesh) -> None:
        """Raises where the rules name an axis ``mesh`` lacks (when the optimizer is built)."""
        if self.rules is not None:
            check_rules(self.rules, mesh)
