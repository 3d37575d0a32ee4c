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
mapped through rules lose jzero's own axes (:func:`jzero.core.rules.drop_own_axes`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.rules import Rules, check_rules, drop_own_axes, logical_to_mesh, to_mesh_axes


def _no_rules(name: str, names: tuple[Any, ...], mesh: Mesh) -> ValueError:
    example = tuple((n, None) for n in names if isinstance(n, str))
    return ValueError(
        f"param {name} has logical axis names {names} (nn.with_logical_partitioning), but no "
        f"rules map them to the mesh's axes {dict(mesh.shape)}; pass rules= to "
        f"TrainState.create, e.g. rules={example} with a mesh axis in place of None where a "
        "dimension should be split (or set them with nn.logical_axis_rules(...)); rules=() "
        "replicates every logical dimension over the mesh's other axes."
    )


def _explicit(param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Explicit specs name mesh axes, or logical axes when ``rules`` are given."""
    return param_specs if rules is None else logical_to_mesh(param_specs, check_rules(rules, mesh))


def linen_specs(params: Any, *, param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Mesh specs for Linen ``params`` (boxed, as ``model.init`` returns them)."""
    if param_specs is not None:
        return _explicit(param_specs, rules, mesh)
    context = nn.get_logical_axis_rules() or None

    def spec(path: Any, x: Any) -> Any:
        if not isinstance(x, nn.LogicallyPartitioned):
            return nn.get_partition_spec(x)
        name = jax.tree_util.keystr(path)
        own = next((r for r in (x.rules, rules, context) if r is not None), None)
        if own is None:
            raise _no_rules(name, tuple(x.names), mesh)
        return to_mesh_axes(name, x.names, check_rules(own, mesh))

    is_box = lambda x: isinstance(x, meta.AxisMetadata)
    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_box)


def nnx_specs(params: nnx.State, *, param_specs: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """Mesh specs for an NNX module's Param state, as a pure dict."""
    if param_specs is not None:
        return _explicit(param_specs, rules, mesh)
    if rules is None:
        return nnx.to_pure_dict(nnx.get_partition_spec(params))
    with nnx.logical_axis_rules(check_rules(rules, mesh)):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    return jax.tree.map(drop_own_axes, specs, is_leaf=lambda x: isinstance(x, P))
