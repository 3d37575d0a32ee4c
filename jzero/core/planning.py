"""The :class:`Plan` for a parameter tree, from the Optax transformation, the mesh and the
run's configuration: what ``ZeroOptimizer.plan``, the checkpointer's restore and the
user's-step layout (``jzero.shard_params``, ``jzero.shard_optimizer``) all place by.

The user's specs over the mesh's other axes come from ``Layout.param_specs`` (mapped by
``Layout.rules`` when given), or with ``rules`` alone from the parameters' own Flax
metadata (:mod:`.boxed`); ``data`` is then added where :mod:`.plan` shards.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .boxed import box_specs, has_boxes
from .input_checks import check_complex, check_leaves
from .mesh import fit_specs
from .options.zero_config import ZeroConfig
from .plan import Plan, make_plan, param_owners
from .rules import logical_to_mesh


def plan_for(tx: optax.GradientTransformation, mesh: Mesh, config: ZeroConfig, params: Any) -> Plan:
    """Where every leaf lives, for ``params`` (arrays or ``jax.ShapeDtypeStruct`` s)."""
    check_leaves(params, "params", allow_empty=False)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_state = jax.eval_shape(tx.init, config.precision.cast(shapes, "float32"))
    check_leaves(opt_state, "optimizer state")
    check_complex(shapes, opt_state, config)
    specs = user_specs(shapes, mesh, config)
    owners = param_owners(tx, jax.tree.structure(shapes), opt_state)
    return make_plan(
        mesh=mesh,
        config=config,
        params=shapes,
        opt_state=opt_state,
        user_specs=specs,
        owners=owners,
    )


def user_specs(shapes: Any, mesh: Mesh, config: ZeroConfig) -> Any:
    """The specs over the mesh's other axes, per parameter leaf (``P()``: none)."""
    specs, rules = config.layout.param_specs, config.layout.rules
    if specs is None and rules is not None:
        return _box_specs(shapes, mesh, rules)
    if specs is None:
        return jax.tree.map(lambda _: P(), shapes)
    try:
        jax.tree.broadcast(specs, shapes, is_leaf=lambda x: isinstance(x, P))
    except ValueError as e:
        raise ValueError(
            f"param_specs does not match the parameter tree ({e}); give a PartitionSpec "
            "per parameter leaf, or a prefix of the tree."
        ) from None
    if rules is not None:
        specs = logical_to_mesh(specs, rules)
    return fit_specs(shapes, specs, mesh, drop_data=False)


def _box_specs(shapes: Any, mesh: Mesh, rules: Any) -> Any:
    """``rules=`` without ``param_specs=``: the specs Flax's metadata on the (boxed)
    parameters gives under the rules; parameters without any are refused."""
    if not has_boxes(shapes):
        raise ValueError(
            "rules= maps logical axis names to mesh axes, but there are none to map: "
            "param_specs= is not given and the parameters carry no Flax partitioning "
            "metadata (they are unboxed), so the rules would change nothing. Pass the "
            "boxed parameters as model.init returns them (variables['params'], not "
            "nn.unbox(...)), or param_specs= naming logical axes, e.g. "
            "nn.get_partition_spec(variables['params']); or use "
            "jzero.linen.TrainState.create(..., rules=) / jzero.nnx.TrainState.create, "
            "which read the metadata. Without logical names, drop rules=."
        )
    specs = box_specs(shapes, rules=rules, mesh=mesh)
    specs = jax.tree.unflatten(jax.tree.structure(shapes), specs)
    return fit_specs(shapes, specs, mesh)
