"""Where a matrix optimizer's update runs: each leaf on whole matrices, along a batch axis.

Muon's Newton-Schulz, Shampoo's preconditioners and GaLore's projections contract the axes
of a weight matrix. Stored along one of those axes (the layout rule shards a stack of
layers inside its matrices), the compiler splits every ``X @ X.T`` of every iteration
into collectives: 4-6.6x the bytes of AdamW's ZeRO step. :func:`mixed_axes` reads, from
the Optax update itself (its jaxpr), which axes of each parameter leaf the update mixes.
A leaf that mixes the axis it is stored along, and has an axis the update does not mix
(a scanned stack's layer axis, Muon's batch dimensions) that the ``data`` size divides,
is updated along that axis instead (:func:`owner_layout`): its optimizer state and master
weights rest there, its reduced gradient comes there by one all-to-all, and its new
values leave by the all-gather stages 1-2 do anyway (stage 3: one all-to-all back).
Each device then orthogonalizes whole matrices, its 1/N of them.

Leaves whose update is elementwise in the axis they are stored along keep their layout
and their program. Mixing leaves with no such axis (an unrolled model's 2-D matrices)
are still updated exactly, split by the compiler, and :meth:`Plan.describe` says so.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec as P

from ..internal.mixed_axes import mixed_axes_of
from ..internal.moved import InternalMoved, warn_fallback
from .leaf_layout import LeafLayout, pad, unpad
from .mesh import DATA

FEATURE = "matrix optimizers on whole matrices"
SPLIT_COST = "a matrix optimizer's update split by the compiler (Muon: 4-6.6x AdamW's bytes)"


class UpdateAxes(NamedTuple):
    """What the Optax update does with each leaf's axes."""

    mixed: tuple[frozenset[int], ...]  # per parameter leaf: the axes its update mixes
    owners: tuple[int, ...]  # per Optax-state leaf: the parameter leaf it belongs to, or -1


def update_axes(
    tx: optax.GradientTransformation, params: Any, opt_state: Any, owners: list[int] | None
) -> UpdateAxes | None:
    """Per parameter leaf, the axes ``tx``'s update mixes: those of its gradient, its
    parameter and the optimizer-state leaves of its shape that it owns. ``owners`` (as
    Optax tells them, :func:`.plan.param_owners`), or where Optax cannot tell (Muon with
    dimension numbers), the parameter whose gradient each new state leaf holds axis for
    axis. None where the update cannot be traced on ``(grads, state, params)`` alone
    (one that needs extra arguments): those leaves keep their layout. Read once per
    transformation and tree of shapes (a trace of the update: 0.15 s at 321 leaves)."""
    shapes = lambda tree: (jax.tree.structure(tree), tuple(_spec(x) for x in jax.tree.leaves(tree)))
    owned = None if owners is None else tuple(owners)
    try:
        return _read(tx, shapes(params), shapes(opt_state), owned)
    except TypeError:  # something unhashable (a transformation's closure): read it again
        return _read.__wrapped__(tx, shapes(params), shapes(opt_state), owned)


def _spec(x: Any) -> tuple:
    return tuple(x.shape), x.dtype


def _abstract(shapes: tuple) -> Any:
    treedef, specs = shapes
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in specs])


@functools.lru_cache(maxsize=64)
def _read(tx: Any, params: tuple, opt_state: tuple, owners: tuple | None) -> UpdateAxes | None:
    params, opt_state = _abstract(params), _abstract(opt_state)
    try:
        found = mixed_axes_of(tx.update, params, opt_state, params)
    except InternalMoved as moved:
        warn_fallback(FEATURE, moved, "every leaf is updated in its stored layout", SPLIT_COST)
        return None
    except Exception:  # noqa: BLE001 -- an update this cannot trace keeps today's layout
        return None
    leaves = jax.tree.leaves(params)
    n, m = len(leaves), len(jax.tree.leaves(opt_state))
    grads, state, weights = found.mixed[:n], found.mixed[n : n + m], found.mixed[n + m :]
    if owners is None:  # the new state (outputs n:) after the updates (outputs :n)
        owners = [_holder(labels, leaves) for labels in found.outputs[n : n + m]]
    out = [g | w for g, w in zip(grads, weights)]
    shapes = [tuple(x.shape) for x in jax.tree.leaves(opt_state)]
    for j, i in enumerate(owners):
        if i >= 0 and shapes[j] == tuple(leaves[i].shape):
            out[i] = out[i] | state[j]
    return UpdateAxes(tuple(out), tuple(owners))


def _holder(labels: tuple, leaves: list) -> int:
    """The one parameter leaf ``i`` whose gradient (input ``i``) a value of its shape holds
    on every axis ``d`` at axis ``d``; -1 if none or several."""
    if not labels:
        return -1
    holders = [
        i
        for i, x in enumerate(leaves)
        if len(x.shape) == len(labels) and all((i, d) in labels[d] for d in range(len(labels)))
    ]
    return holders[0] if len(holders) == 1 else -1


@dataclasses.dataclass(frozen=True)
class MatrixUpdate:
    """How a run's update treats each leaf's axes (static; :attr:`Plan.matrices`).

    Attributes:
        mixed: per parameter leaf, the axes its Optax update mixes.
        state_owners: per Optax-state leaf, the parameter leaf it belongs to, or -1.
        layouts: per parameter leaf, its owner layout (:func:`owner_layout`): the layout
            its update runs in and its state and master weights rest in; None for others.
        stacks: per parameter leaf, the stack of same-shaped mixing leaves it is updated
            in (:mod:`jzero.internal.leaf_batching`), numbered; None for others.
    """

    mixed: tuple[frozenset[int], ...]
    state_owners: tuple[int, ...]
    layouts: tuple[LeafLayout | None, ...]
    stacks: tuple[int | None, ...]

    def stack_groups(self) -> list[list[int]]:
        """The parameter leaves of each stack, in order."""
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(self.stacks):
            if b is not None:
                groups.setdefault(b, []).append(i)
        return [groups[b] for b in sorted(groups)]


def matrix_update(axes: UpdateAxes, layouts: list[LeafLayout], n: int, on: bool) -> MatrixUpdate:
    """Where each mixing leaf's update runs, for parameter ``layouts`` on a ``data`` axis
    of ``n`` (``on``: ZeRO partitions the optimizer state and it stays on the device):
    along its owner axis where it has one, else in a stack of the leaves of its shape and
    dtype whose stored axis it mixes."""
    owned = [owner_layout(lay, m, n) if on else None for lay, m in zip(layouts, axes.mixed)]
    stacks: list[int | None] = []
    shapes: dict[tuple, int] = {}
    for lay, m, o in zip(layouts, axes.mixed, owned):
        split = on and o is None and lay.sharded and lay.dim in m
        stacks.append(shapes.setdefault(lay.shape, len(shapes)) if split else None)
    return MatrixUpdate(axes.mixed, axes.owners, tuple(owned), tuple(stacks))


def owner_layout(lay: LeafLayout, mixed: frozenset[int], n: int) -> LeafLayout | None:
    """The layout ``lay``'s leaf is updated in when its update mixes the axis it is stored
    along: sharded instead along the first axis the update leaves alone, the user's spec
    leaves free and ``n`` divides (no padding). None where ``lay`` serves (unsharded, or
    stored along an axis the update does not mix) or no such axis exists."""
    if not lay.sharded or lay.dim not in mixed:
        return None
    entries = list(lay.user_spec) + [None] * (len(lay.shape) - len(lay.user_spec))
    batch = [
        d
        for d, size in enumerate(lay.shape)
        if d not in mixed and entries[d] is None and size > 0 and size % n == 0
    ]
    if not batch:
        return None
    entries[batch[0]] = DATA
    while entries and entries[-1] is None:
        entries.pop()
    return LeafLayout(lay.shape, batch[0], lay.shape, P(*entries), lay.user_spec)


def relaid(x: jax.Array, src: LeafLayout, dst: LeafLayout, mesh: Any, axes: Any) -> jax.Array:
    """``x`` (true shape, sharded over ``data`` as ``src`` says) laid out as ``dst``: one
    all-to-all where both shard it, a local slice where ``src`` replicates it, the
    all-gather of the whole where ``dst`` replicates it. ``mesh``: the compute mesh;
    ``axes``: the ``shard_map``'s manual axes."""
    if src.dim == dst.dim:
        return x
    if not src.sharded or not dst.sharded:
        spec = dst.spec if dst.sharded else dst.user_spec
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
    stored = pad(x, src)
    stored = jax.lax.with_sharding_constraint(stored, jax.sharding.NamedSharding(mesh, src.spec))
    body = lambda s: jax.lax.all_to_all(
        s, DATA, split_axis=dst.dim, concat_axis=src.dim, tiled=True
    )
    moved = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=src.data_spec(),
        out_specs=dst.data_spec(),
        axis_names=set(axes),
        check_vma=False,
    )(stored)
    return unpad(moved, src)


def relaid_tree(tree: Any, src: tuple, dst: tuple, mesh: Any, axes: Any) -> Any:
    """:func:`relaid` of every leaf of ``tree`` from its ``src`` layout to its ``dst``."""
    leaves, treedef = jax.tree.flatten(tree)
    moved = [relaid(x, s, d, mesh, axes) for x, s, d in zip(leaves, src, dst)]
    return treedef.unflatten(moved)
