"""The Optax update with each stack of same-shaped mixing leaves run as one.

:class:`.update_layout.MatrixUpdate` puts the mixing leaves that have no axis of their
own to be updated along (an unrolled model's 2-D weight matrices) into stacks by shape.
:func:`stacked` returns ``tx.update`` with each stack's per-leaf work batched
(:mod:`jzero.internal.leaf_batching`): where the update starts to mix a leaf's axes
(Muon's Newton-Schulz, after its elementwise momentum), the leaves' values are stacked
and laid out along the stack (``data`` on its leading axis, padded to a multiple of N: the
compiler moves them by all-to-all), so each device works on whole matrices, its 1/N of
them; what the update returns comes back to each leaf's stored layout the same way.
Numbers are the update's own: each leaf's equations run as traced, ``jax.vmap``-ed.

A stack of one leaf is not padded to N slots: it is gathered whole onto every device and
updated there, each device keeping its shard. A padded stack would move the leaf twice
(in and out by all-to-all, ``2·(N-1)/N`` of it per device, the padding included) for the
same per-device FLOPs (one matrix: the padding slots compute zeros); gathered, it moves
once (``(N-1)/N``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..internal.leaf_batching import plan_batching, run_batching
from ..internal.moved import InternalMoved, warn_fallback
from .mesh import DATA
from .plan import Plan
from .update_layout import FEATURE, SPLIT_COST

Update = Callable[[Any, Any, Any], tuple[Any, Any]]


def stacked(plan: Plan, tx: optax.GradientTransformation, layouts: Any = None) -> Update:
    """``tx.update(grads, state, params)`` with ``plan``'s stacks batched, evaluated from
    its jaxpr with its scans rolled (:mod:`jzero.internal.leaf_batching`); ``tx.update``
    itself where no leaf's update mixes axes (the elementwise optimizers' program as it
    was). ``layouts``: per parameter leaf, the spec its values
    come back in (default: each leaf's stored layout, :attr:`Plan.layouts`)."""
    if plan.matrices is None or not any(plan.matrices.mixed):
        return tx.update
    groups = plan.matrices.stack_groups()
    specs = layouts or [lay.spec for lay in plan.layouts]
    stack, unstack = _stackers(plan, groups, specs)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        g, s, p = (jax.tree.leaves(t) for t in (grads, state, params))
        n, m = len(g), len(s)
        roles = _roles(groups, plan.matrices.state_owners, n, m)
        treedefs = [jax.tree.structure(t) for t in (grads, state, params)]

        def flat_update(*a: Any) -> list[Any]:
            trees = (a[:n], a[n : n + m], a[n + m :])
            args = [jax.tree.unflatten(d, list(t)) for d, t in zip(treedefs, trees)]
            return jax.tree.leaves(tx.update(*args))

        flat = [*g, *s, *p]
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
        try:
            batching = plan_batching(flat_update, abstract, roles)
            if batching is None:  # the update treats a stack's leaves differently
                return tx.update(grads, state, params)
            outs = run_batching(batching, flat, stack, unstack)
        except InternalMoved as moved:
            warn_fallback(FEATURE, moved, "the update runs as the compiler splits it", SPLIT_COST)
            return tx.update(grads, state, params)
        out_def = jax.tree.structure(jax.eval_shape(tx.update, grads, state, params))
        return jax.tree.unflatten(out_def, outs)

    return update


def _roles(groups: list[list[int]], owners: tuple[int, ...], n: int, m: int) -> list:
    """Per stack, per leaf, its flat inputs: gradient, Optax-state leaves, parameter."""
    state = lambda i: [n + j for j, o in enumerate(owners) if o == i]
    return [[[i, *state(i), n + m + i] for i in group] for group in groups]


def _stackers(plan: Plan, groups: list[list[int]], specs: Any) -> tuple[Callable, Callable]:
    mesh, size = plan.compute_mesh, plan.data_size
    shapes = [lay.shape for lay in plan.layouts]

    def stack(b: int, values: list[jax.Array]) -> jax.Array:
        x = jnp.stack(values)
        if len(values) == 1:  # whole on every device: half a padded stack's bytes
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
        pad = -len(values) % size
        if pad:
            x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA)))

    def unstack(b: int, x: jax.Array) -> list[jax.Array]:
        out = []
        for j, i in enumerate(groups[b]):
            leaf = x[j]
            if tuple(leaf.shape) == shapes[i]:
                leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, specs[i]))
            out.append(leaf)
        return out

    return stack, unstack
