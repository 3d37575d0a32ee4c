"""Process-local batches -> the global batch jzero's step takes.

In a multi-process run each process usually loads only its own rows (its slice of the
global batch). ``global_batch`` assembles them into one global ``jax.Array`` sharded over
the mesh's ``data`` axis, without moving data between processes: process p's rows land on
process p's devices. A plain numpy batch is refused by the step in a multi-process run,
because it is ambiguous (the whole global batch on every process, or this process's rows?).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.mesh import DATA


def global_batch(mesh: Mesh, local_batch: Any) -> Any:
    """This process's rows of every batch leaf -> global arrays split over ``data``.

    Every process calls it with the same number of rows; the global batch has
    ``jax.process_count()`` times as many, in process order. In a single-process run it
    places the batch (the global batch is the local one).

    Args:
        mesh: the optimizer's mesh.
        local_batch: a pytree of arrays with a leading batch axis: this process's rows.

    Examples:
        >>> rows = dataset.shard(jax.process_index(), jax.process_count())  # doctest: +SKIP
        >>> state, metrics = train_step(state, jzero.distributed.global_batch(mesh, rows))
    """
    sharding = NamedSharding(mesh, P(DATA))
    local = mesh.local_mesh.shape.get(DATA, 1)

    def one(path: Any, x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % local:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {x.shape}; this "
                f"process's rows must split over its {local} devices on 'data': use a local "
                f"batch size that is a multiple of {local}."
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map_with_path(one, local_batch)
