"""Parameter specs read from Flax's partitioning metadata on the parameters themselves.

Flax keeps a parameter's partitioning beside its value: Linen boxes it
(``nn.with_partitioning`` -> ``nn.Partitioned``, naming mesh axes;
``nn.with_logical_partitioning`` -> ``nn.LogicallyPartitioned``, naming logical axes), and
NNX stores the names in a Variable's ``out_sharding`` (``nnx.with_partitioning``).
:func:`box_specs` reads them with Flax's own API -- ``nn.get_partition_spec``,
``nn.logical_to_mesh_axes`` (through :func:`.rules.to_mesh_axes`) and
``nnx.get_partition_spec`` under ``nnx.logical_axis_rules`` -- into one mesh
``PartitionSpec`` per array leaf. :class:`jzero.ZeroOptimizer` reads boxed parameters
through it when given ``rules=`` without ``param_specs=``, and so do both Flax adapters.
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from flax.nnx import spmd as nnx_spmd
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .rules import Rules, check_rules, drop_own_axes, to_mesh_axes


def is_box(x: Any) -> bool:
    """Whether ``x`` carries Flax partitioning metadata (a Linen box or an NNX Variable)."""
    return isinstance(x, meta.AxisMetadata | nnx.Variable)


def has_boxes(tree: Any) -> bool:
    """Whether any node of ``tree`` is a Linen box or an NNX Variable."""
    return any(map(is_box, jax.tree.leaves(tree, is_leaf=is_box)))


def no_rules_error(name: str, names: tuple[Any, ...], mesh: Mesh) -> ValueError:
    """A Linen parameter names logical axes and no rules map them."""
    example = tuple((n, None) for n in names if isinstance(n, str))
    return ValueError(
        f"param {name} has logical axis names {names} (nn.with_logical_partitioning), but no "
        f"rules map them to the mesh's axes {dict(mesh.shape)}; pass rules= to "
        f"TrainState.create, e.g. rules={example} with a mesh axis in place of None where a "
        "dimension should be split (or set them with nn.logical_axis_rules(...)); rules=() "
        "replicates every logical dimension over the mesh's other axes."
    )


def _linen_spec(name: str, box: Any, rules: Rules | None, mesh: Mesh) -> P | None:
    """A Linen box's mesh spec: ``nn.Partitioned`` names mesh axes and is kept; the logical
    names of ``nn.LogicallyPartitioned`` are mapped by the box's own rules, else ``rules``."""
    if not isinstance(box, nn.LogicallyPartitioned):
        return nn.get_partition_spec(box)
    own = box.rules if box.rules is not None else rules
    if own is None:
        raise no_rules_error(name, tuple(box.names), mesh)
    return to_mesh_axes(name, tuple(box.get_partition_spec()), check_rules(own, mesh))


def _nnx_spec(variable: Any, rules: Rules | None, mesh: Mesh) -> P | None:
    """An NNX Variable's mesh spec, by ``nnx.get_partition_spec`` under ``rules`` (None: the
    ``nnx.logical_axis_rules`` context), with the Variable's own ``sharding_rules``."""
    if rules is None:
        context = contextlib.nullcontext()
    else:
        context = nnx.logical_axis_rules(check_rules(rules, mesh))
    with context:
        spec = _variable_spec(variable)
    return spec if rules is None else drop_own_axes(spec)


def _variable_spec(variable: Any) -> P | None:
    """``nnx.get_partition_spec`` of one Variable. A hijax Variable (``nnx.var_defaults(
    hijax=True)``) cannot hold the spec it would return it in (Flax 0.12 rebuilds the
    Variable around it: "P() is not a valid JAX type"), so its spec is read with the rule
    ``nnx.get_partition_spec`` applies to each Variable, ``flax.nnx.spmd.get_var_pspec``."""
    if getattr(variable, "hijax", False) and hasattr(nnx_spmd, "get_var_pspec"):
        return nnx_spmd.get_var_pspec(variable)
    return jax.tree.leaves(nnx.get_partition_spec(variable), is_leaf=_is_spec)[0]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def box_specs(params: Any, *, rules: Rules | None, mesh: Mesh) -> list[P | None]:
    """One mesh spec per array leaf of ``params`` (in ``jax.tree.leaves`` order), read from
    the Flax metadata around it; a leaf with none gets ``P()``.

    Args:
        params: the parameters, boxed (Linen, as ``model.init`` returns them) or an
            ``nnx.State`` of Variables; arrays or ``jax.ShapeDtypeStruct`` s.
        rules: logical axis rules for names a box's own rules do not map (Linen: required
            where a ``LogicallyPartitioned`` box has none; NNX: None reads the
            ``nnx.logical_axis_rules`` context). Mapped specs lose jzero's own axes.
        mesh: the mesh whose axes the rules may name.
    """
    specs: list[P | None] = []
    for path, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
        if isinstance(node, nnx.Variable):
            spec = _nnx_spec(node, rules, mesh)
        elif isinstance(node, meta.AxisMetadata):
            spec = _linen_spec(jax.tree_util.keystr(path), node, rules, mesh)
        else:
            spec = P()
        specs += [spec] * len(jax.tree.leaves(node))
    return specs
