"""The parameters' specs from Flax metadata, logical axis names mapped through rules.

Each adapter reads its Flax API's annotations and maps them as that API does:

- Linen: ``nn.with_partitioning`` names mesh axes and is kept; ``nn.with_logical_partitioning``
  names logical axes, mapped by ``nn.logical_to_mesh_axes`` with, in order of precedence,
  the variable's own ``rules``, ``rules=``, or the ``nn.logical_axis_rules`` context (a
  name with no rule is replicated). Logical names with no rules at all are an error.
- NNX: ``nnx.with_partitioning`` / ``out_sharding`` metadata, mapped by
  ``nnx.get_partition_spec`` under ``rules=`` (else the ``nnx.logical_axis_rules``
  context), combined with the variable's ``sharding_rules``; NNX keeps a name with no rule
  as it is, so it must then be a mesh axis.

Explicit ``param_specs`` name mesh axes, or logical axes when ``rules=`` is given. Specs
mapped through rules lose jzero's own axes (:func:`jzero.core.param_specs.drop_own_axes`). The
metadata is read by :func:`jzero.core.param_specs.box_specs`, which ``jzero.ZeroOptimizer`` uses
for boxed parameters too.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh

from ..core.param_specs import Rules, box_specs, check_rules, logical_to_mesh


def _explicit(param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Explicit specs name mesh axes, or logical axes when ``rules`` are given."""
    return param_specs if rules is None else logical_to_mesh(param_specs, check_rules(rules, mesh))


def linen_specs(params: Any, *, param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Mesh specs for Linen ``params`` (boxed, as ``model.init`` returns them), shaped like
    the unboxed parameters."""
    if param_specs is not None:
        return _explicit(param_specs, rules, mesh)
    fallback = rules if rules is not None else (nn.get_logical_axis_rules() or None)
    specs = box_specs(params, rules=fallback, mesh=mesh)
    return jax.tree.unflatten(jax.tree.structure(nn.unbox(params)), specs)


def nnx_specs(params: nnx.State, *, param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Mesh specs for an NNX module's Param state, as a pure dict."""
    if param_specs is not None:
        return _explicit(param_specs, rules, mesh)
    specs = box_specs(params, rules=rules, mesh=mesh)
    return jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(params)), specs)
