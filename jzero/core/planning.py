"""The :class:`Plan` for a parameter tree, from the Optax transformation, the mesh and the
run's configuration: what ``ZeroOptimizer.plan``, the checkpointer's restore and the
user's-step layout (``jzero.shard_params``, ``jzero.shard_optimizer``) all place by.

The user's specs over the mesh's other axes come from :mod:`.param_specs`; ``data`` is
then added where :mod:`.plan` shards.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh

from .input_checks import check_complex, check_leaves
from .options.zero_config import ZeroConfig
from .param_specs import user_specs
from .plan import Plan, make_plan, param_owners
from .update_layout import update_axes


def plan_for(tx: optax.GradientTransformation, mesh: Mesh, config: ZeroConfig, params: Any) -> Plan:
    """Where every leaf lives, for ``params`` (arrays or ``jax.ShapeDtypeStruct`` s)."""
    check_leaves(params, "params", allow_empty=False)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_state = jax.eval_shape(tx.init, config.precision.cast(shapes, "float32"))
    check_leaves(opt_state, "optimizer state")
    check_complex(shapes, opt_state, config)
    specs = user_specs(shapes, mesh, config.layout.param_specs, config.layout.rules)
    owners = param_owners(tx, jax.tree.structure(shapes), opt_state)
    fp32 = config.precision.cast(shapes, "float32")
    axes = update_axes(tx, fp32, opt_state, owners)
    return make_plan(
        mesh=mesh,
        config=config,
        params=shapes,
        opt_state=opt_state,
        user_specs=specs,
        owners=owners,
        axes=axes,
    )
