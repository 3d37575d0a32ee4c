"""Where :func:`jzero.shard_optimizer` puts each leaf: ``PartitionSpec`` s in true shapes.

The user's own step sees true shapes only (it calls ``optax.apply_updates`` on its own
parameters), so a leaf is sharded along ``data`` where ZeRO's own rule
(:func:`jzero.core.leaf_layout.leaf_layout`, with the :class:`jzero.Layout` options) picks a
dimension that ``data``'s size divides, and stays replicated over ``data`` where it would
need padding. Specs come from the same :class:`jzero.Plan` as ``ZeroOptimizer``'s, so the
user's other mesh axes, logical rules and Flax metadata are read as there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from ...core.mesh import DATA
from ...core.plan import Plan, Stored


class UserLayout(NamedTuple):
    """The specs of one parameter tree's leaves, each a tree of ``PartitionSpec``."""

    params: Any  # shaped like the params: where they rest (along 'data' at stage 3)
    shards: Any  # shaped like the params: along 'data' where a dimension divides its size
    state: Any  # shaped like the Optax state: along 'data' at stages 1-3
    master: Any  # shaped like the params: the fp32 master weights'; None without them
    update: Any  # shaped like the params: where the update runs (a mixing leaf's owner axis)
    plan: Plan  # the plan the specs come from


def _true(stored: Stored, partitioned: bool, n: int) -> P:
    """The spec of ``stored`` in true shapes: its sharded spec where that needs no padding,
    else along the leading dimension where ``n`` divides it (the padded rule keeps that
    dimension for last, as a possible stack of layers), else replicated over ``data``."""
    lay = stored.layout
    if not (partitioned and lay.sharded):
        return lay.user_spec
    if not lay.pad:
        return lay.spec
    entries = list(lay.user_spec) + [None] * (len(lay.shape) - len(lay.user_spec))
    if entries[0] is not None or lay.shape[0] % n:
        return lay.user_spec
    entries[0] = DATA
    while entries[-1] is None:
        entries.pop()
    return P(*entries)


def user_layout(plan: Plan) -> UserLayout:
    """The specs of ``plan``'s parameters, state and master weights, in true shapes."""
    n = plan.data_size
    tree = lambda treedef, specs: jax.tree.unflatten(treedef, list(specs))
    params = tree(plan.params_def, (_true(s, s.partitioned, n) for s in plan.params))
    shards = tree(plan.params_def, (_true(s, plan.stage >= 1, n) for s in plan.params))
    state = tree(plan.opt_def, (_true(s, s.partitioned, n) for s in plan.opt))
    master = plan.master and tree(
        plan.params_def, (_true(s, s.partitioned, n) for s in plan.master)
    )
    owners = [
        shard if o is None else o.spec
        for shard, o in zip(jax.tree.leaves(shards), plan.owner_layouts)
    ]
    return UserLayout(params, shards, state, master, tree(plan.params_def, owners), plan)
