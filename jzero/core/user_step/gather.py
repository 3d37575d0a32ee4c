"""Stage 3 in the user's own step: parameters gathered where the loss uses them.

Given only the parameters' sharded layout, the compiler's partitioner may keep a weight
sharded and reshard the activations around it instead (measured, XLA:CPU jax 0.12, the
example GPT at stage 3: 10 x the gathers' bytes in all-reduces, all-gathers and permutes
of activations, 2 x zero3's compiled peak). Constraining each layer's parameters to be
whole where it uses them is the annotation that makes it gather them, one layer at a time
inside a scan, again in backward under remat: ZeRO-3's schedule.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..mesh import DATA, REPLICA


def _in_manual_data() -> bool:
    """Inside a ``shard_map`` over ``data`` (jzero's own step): arrays are local already."""
    return DATA in jax.sharding.get_abstract_mesh().manual_axes


def whole_over_data(tree: Any, mesh: Mesh) -> Any:
    """``tree``'s arrays constrained whole (replicated) on ``mesh``, which may have no axes
    of size > 1 but ``data`` and ``replica``; inside jzero's own ``shard_map``, as they are."""
    others = {a: n for a, n in mesh.shape.items() if a not in (DATA, REPLICA) and n > 1}
    if others:
        raise ValueError(
            f"jzero.gather(..., mesh=) makes each leaf whole on the mesh, but the mesh has the "
            f"axes {others} besides 'data': that would gather them too. Constrain each leaf "
            "yourself to its spec without 'data', e.g. jax.lax.with_sharding_constraint(w, "
            "NamedSharding(mesh, P(None, 'model')))."
        )
    if _in_manual_data():
        return tree
    whole = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _whole(x, whole), tree)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _whole(x: jax.Array, whole: NamedSharding) -> jax.Array:
    """``x`` constrained whole, its cotangent left unconstrained: the compiler reduces it
    onto the gradient's own layout (a reduce-scatter where the optimizer constrains it onto
    its shards, inside the loop step that computes it), where the constraint's transpose
    would constrain it whole (an all-reduce of every layer's gradient)."""
    return jax.lax.with_sharding_constraint(x, whole)


def _whole_fwd(x, whole):
    return _whole(x, whole), None


def _whole_bwd(whole, _, ct):
    return (ct,)


_whole.defvjp(_whole_fwd, _whole_bwd)
