"""What a jzero checkpoint holds: named arrays in their stored layout, and JSON metadata.

The ``state`` item is a flat dict ``{name: array}``; names are dotted key paths within
groups: ``step``, ``weights.*`` (the fp32 master weights under mixed precision, else the
parameters), ``opt_state.*``, ``model_state.*``, ``loss_scale.*``. Each array is stored as
it was at rest (padded where partitioned); ``meta`` records its true shape, dtype and
checksum.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..core.plan import Plan, Stored
from ..core.state import ZeroState
from .names import leaf_names

FORMAT, VERSION = "jzero-checkpoint", 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: missing, corrupt, or of another model."""


def leaf_key(group: str, name: str) -> str:
    return f"{group}.{name}" if name else group


def weights_stored(plan: Plan) -> tuple[Stored, ...]:
    """Where the fp32 weights live: the master weights' layout, else the parameters'."""
    return plan.master if plan.master is not None else plan.params


def flatten(state: ZeroState) -> tuple[dict[str, jax.Array], dict[str, tuple[int, ...]]]:
    """The state as ``{name: stored array}`` and ``{name: true shape}``."""
    plan = state.plan
    weights = state.master if plan.master is not None else state.params
    groups = [
        ("weights", weights, [s.layout.shape for s in weights_stored(plan)]),
        ("opt_state", state.opt_state, [s.layout.shape for s in plan.opt]),
        ("model_state", state.model_state, None),
        ("loss_scale", state.loss_scale, None),
    ]
    arrays, shapes = {"step": state.step}, {"step": ()}
    for group, tree, true in groups:
        leaves = jax.tree.leaves(tree)
        true = true if true is not None else [tuple(x.shape) for x in leaves]
        for name, x, shape in zip(leaf_names(tree), leaves, true):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # e.g. NNX RNG streams
                x = jax.random.key_data(x)  # saved as raw uint32; restore(model_state=) types it
                shape = x.shape
            arrays[leaf_key(group, name)] = x
            shapes[leaf_key(group, name)] = tuple(int(d) for d in shape)
    return arrays, shapes


def array_target(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)
