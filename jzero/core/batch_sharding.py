"""Where the global batch lives: its rows split over every batch axis of the mesh.

The step splits each batch leaf's leading (row) axis over ``'data'``, and over
``('replica', 'data')`` on a hybrid mesh (:attr:`Plan.batch_axes`). A global batch built
with a sharding that names fewer axes is not just slower: when the missing axis spans
processes (``hybrid_mesh`` across hosts), ``jax.make_array_from_process_local_data`` takes
each process's rows for a replicated copy of the whole batch, so the array is half the
intended size and its copies differ between processes -- the step would train on the wrong
rows without an error. :func:`check_batch_sharding` refuses such a batch instead.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import DATA, REPLICA


def batch_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The mesh axes a batch's rows are split over: ``('replica', 'data')`` or ``'data'``."""
    return (REPLICA, DATA) if REPLICA in mesh.axis_names else DATA


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding the step expects of every batch leaf: rows over :func:`batch_axes`."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def check_batch_sharding(batch: Any, mesh: Mesh) -> None:
    """In a multi-process run, every global batch leaf is sharded as :func:`batch_sharding`.

    A single process can reshard any array exactly (the step does), so only a run of
    several processes is checked. Leaves that are not ``jax.Array`` are left to
    :func:`jzero.core.input_checks.check_global_batch`, scalars to the step's batch check.
    """
    if jax.process_count() == 1:
        return
    expected = batch_sharding(mesh)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not isinstance(x, jax.Array) or x.ndim == 0:
            continue
        if not x.sharding.is_equivalent_to(expected, x.ndim):
            axes = batch_axes(mesh)
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} (shape {tuple(x.shape)}) is placed "
                f"as {_describe(x.sharding, mesh)}, but the step splits its rows over the axes "
                f"{axes!r} of the mesh {dict(mesh.shape)}; in a run of {jax.process_count()} "
                "processes such an array is not resharded, because a batch built for fewer "
                "axes holds different rows on different processes. Build it with "
                "jzero.distributed.global_batch(mesh, local_rows), or "
                f"jax.make_array_from_process_local_data(NamedSharding(mesh, P({axes!r})), "
                "local_rows)."
            )


def _describe(sharding: jax.sharding.Sharding, mesh: Mesh) -> str:
    if isinstance(sharding, NamedSharding):
        other = "" if sharding.mesh == mesh else f" on another mesh {dict(sharding.mesh.shape)}"
        return f"{sharding.spec}{other}"
    return f"a {type(sharding).__name__} over {len(sharding.device_set)} device(s)"
