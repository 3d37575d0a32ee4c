"""Process-local batches -> the global batch jzero's step takes.

In a multi-process run each process usually loads only its own rows (its slice of the
global batch). ``global_batch`` assembles them into one global ``jax.Array`` whose rows are
split over every batch axis of the mesh -- ``'data'``, and ``('replica', 'data')`` on a
hybrid mesh -- exactly as the step expects them, without moving data between processes:
process p's rows land on process p's devices. A plain numpy batch is refused by the step in
a multi-process run, because it is ambiguous (the whole global batch on every process, or
this process's rows?), and so is a global array sharded over fewer axes than the step's
(:mod:`jzero.core.batch_sharding`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..core.batch_sharding import batch_axes, batch_sharding
from ..core.gpu_target.compile_only import check_runnable


def global_batch(mesh: Mesh, local_batch: Any) -> Any:
    """This process's rows of every batch leaf -> global arrays split over the batch axes.

    Every process calls it with the same number of rows. The rows are split over
    ``'data'`` (and ``'replica'`` on a hybrid mesh, e.g. ``jzero.hybrid_mesh(hosts)`` with
    one replica per host), so the global batch has ``jax.process_count()`` times as many
    rows, in the order the mesh lays out the processes' devices (process order for meshes
    built from ``jax.devices()``). In a single-process run it places the batch (the global
    batch is the local one).

    Args:
        mesh: the optimizer's mesh.
        local_batch: a pytree of arrays with a leading batch axis: this process's rows.

    Examples:
        >>> rows = dataset.shard(jax.process_index(), jax.process_count())  # doctest: +SKIP
        >>> state, metrics = train_step(state, jzero.distributed.global_batch(mesh, rows))
    """
    check_runnable(mesh, "jzero.distributed.global_batch")  # compile-only GPUs hold no data
    sharding = batch_sharding(mesh)
    local = _local_row_groups(sharding)

    def one(path: Any, x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % local:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {x.shape}; this "
                f"process's rows must split over its {local} devices on {batch_axes(mesh)!r}: "
                f"use a local batch size that is a multiple of {local}."
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map_with_path(one, local_batch)


def _local_row_groups(sharding: NamedSharding) -> int:
    """How many distinct slices of the rows this process's devices hold."""
    rows = sharding.mesh.size  # one row per batch shard is enough to see the slices
    index = sharding.addressable_devices_indices_map((rows,))
    return len({(i[0].start, i[0].stop) for i in index.values()})
