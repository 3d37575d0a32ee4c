"""What a jzero checkpoint holds: named arrays in their stored layout, and JSON metadata.

The ``state`` item is a flat dict ``{name: array}``; names are dotted key paths within
groups: ``step``, ``weights.*`` (the fp32 master weights under mixed precision, else the
parameters), ``opt_state.*``, ``model_state.*``, ``loss_scale.*`` and, with
``Offload(delay=1)``, ``pending.*`` (the gradient the next delayed step applies). Each
array is stored as it was at rest (padded where partitioned); ``meta`` records its true
shape, dtype and checksum, and ``meta_checksum`` the metadata's own (:func:`meta_checksum`;
absent in checkpoints of older jzero, which are read unchecked).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax

from ..core.leaf_names import leaf_names
from ..core.plan import Plan, Stored, ZeroState
from .errors import CheckpointError as CheckpointError

FORMAT, VERSION = "jzero-checkpoint", 1


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
    if plan.pending is not None:  # Offload(delay=1): the gradient the next step applies
        groups.append(("pending", state.pending, [s.layout.shape for s in plan.pending] + [(), ()]))
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


def build_meta(
    state: ZeroState, step: int, shapes: dict[str, tuple[int, ...]], arrays: dict, sums: list
) -> dict[str, Any]:
    """The ``meta`` item: per leaf its true shape, dtype and checksum; how it was written
    (stage, mesh, precision, the Optax state's types); the caller's ``extra`` is added."""
    plan = state.plan
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "stage": plan.stage,
        "devices": plan.data_size,
        "mesh": {str(k): int(v) for k, v in plan.mesh.shape.items()},
        "mixed_precision": plan.master is not None,
        "param_dtypes": sorted({str(s.dtype) for s in plan.params}),
        "opt_state_types": state_types(plan.opt_def),
        "leaves": {
            name: {"shape": list(shapes[name]), "dtype": str(x.dtype), "checksum": c}
            for (name, x), c in zip(arrays.items(), sums)
        },
    }


META_CHECKSUM = "meta_checksum"
"""The metadata's own checksum: sha256 of the rest of it as canonical JSON."""


def meta_checksum(meta: dict[str, Any]) -> str:
    """The checksum of ``meta`` (all but its own checksum): sha256 of its canonical JSON
    (sorted keys, no spaces), which a JSON round trip leaves unchanged."""
    rest = {k: v for k, v in meta.items() if k != META_CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def meta_damage(meta: dict[str, Any]) -> str | None:
    """Why ``meta`` (as read back) is damaged: its checksum differs from its content's;
    None when it agrees, or was written by a jzero that stored none (not checked)."""
    stored = meta.get(META_CHECKSUM)
    if stored is None:
        return None
    got = meta_checksum(meta)
    if got == stored:
        return None
    return (
        f"its metadata fails its checksum (stored {stored[:16]}..., computed {got[:16]}...): "
        "the metadata file changed after it was written, so its shapes, dtypes and checksums "
        "cannot be trusted"
    )


def state_types(treedef: Any) -> list[str]:
    """The class names of an Optax state's NamedTuples, outermost first, e.g.
    ``['ScaleByAdamState', 'EmptyState']`` for ``optax.adam``: how error messages name the
    optimizer a checkpoint was written with."""
    names: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            names.append(type(node).__name__)
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, tuple | list | dict):
            for child in children:
                walk(child)

    walk(jax.tree.unflatten(treedef, [0] * treedef.num_leaves))
    return names
