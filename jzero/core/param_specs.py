"""The user's specs of every parameter over the mesh's other axes (not ``data``, which
jzero places by its layout rule), from whichever of three forms the user gives.

- ``param_specs``: ``PartitionSpec`` s naming mesh axes, or logical axes when ``rules`` are
  given.
- ``rules``: pairs ``(logical_name, mesh_axes)`` as ``nn.logical_axis_rules`` takes them,
  for models annotated with ``nn.with_logical_partitioning`` (lm1b, MaxText-style models:
  ``('embed', 'mlp')``). The mapping is Flax's own (:func:`flax.linen.logical_to_mesh_axes`):
  rules in order of precedence, each mesh axis used once per array, a name with no rule
  replicated.
- Flax's partitioning metadata on the parameters themselves: Linen boxes it
  (``nn.with_partitioning`` -> ``nn.Partitioned``, naming mesh axes;
  ``nn.with_logical_partitioning`` -> ``nn.LogicallyPartitioned``, naming logical axes), and
  NNX stores the names in a Variable's ``out_sharding`` (``nnx.with_partitioning``).
  :func:`box_specs` reads them with Flax's own API -- ``nn.get_partition_spec``,
  ``nn.logical_to_mesh_axes`` and ``nnx.get_partition_spec`` under
  ``nnx.logical_axis_rules``; both Flax adapters read them through it too.

Specs mapped through rules lose jzero's own axes: ``data`` (an FSDP rule such as
``('embed', 'data')`` kept from a pjit setup gives that dimension back to jzero) and
``replica`` (model states are replicated across it). :func:`user_specs` gives the result,
checked against the mesh, one spec per parameter leaf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from flax.nnx import spmd as nnx_spmd
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .mesh import DATA, REPLICA, fit_specs

Rule = tuple[str, str | tuple[str, ...] | None]
"""``(logical_name, mesh_axes)``: a mesh axis name, a tuple of them, or None (replicated)."""

Rules = Sequence[Rule]


def as_rules(rules: Rules) -> tuple[Rule, ...]:
    """``rules`` as a tuple of ``(str, str | tuple | None)`` pairs (checked when the
    configuration is built; :func:`check_rules` checks them against a mesh)."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"rules must be a sequence of (logical_name, mesh_axes) pairs, as "
            f"nn.logical_axis_rules takes, e.g. (('embed', None), ('mlp', 'model')); got "
            f"{type(rules).__name__}."
        )
    return tuple(_rule(rule) for rule in rules)


def _rule(rule: Any) -> Rule:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
        raise TypeError(
            f"rules entry {rule!r} is not a (logical_name, mesh_axes) pair; write e.g. "
            "('mlp', 'model'), ('embed', None) or ('heads', ('model', 'expert'))."
        )
    logical, target = rule
    if isinstance(target, list):
        target = tuple(target)
    if not all(isinstance(a, str) for a in _axes(target)) or not (
        target is None or isinstance(target, (str, tuple))
    ):
        raise TypeError(
            f"rules entry {rule!r} maps {logical!r} to {target!r}; give a mesh axis name, "
            "a tuple of them, or None (replicated)."
        )
    return (logical, target)


def _axes(target: Any) -> tuple:
    return (target,) if isinstance(target, str) else tuple(target or ())


def check_rules(rules: Rules, mesh: Mesh) -> tuple[Rule, ...]:
    """:func:`as_rules`, every mesh axis named in them checked to be one of ``mesh``'s."""
    rules = as_rules(rules)
    for logical, target in rules:
        for axis in _axes(target):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"rules entry {(logical, target)!r} maps {logical!r} to mesh axis "
                    f"{axis!r}, but the mesh has axes {dict(mesh.shape)}; map it to one of "
                    f"them (or None to replicate), or add a {axis!r} axis to the mesh."
                )
    return rules


def _drop_own_axes(entry: Any) -> Any:
    """A spec entry without jzero's own axes (``data`` is placed by jzero, ``replica``
    replicated over)."""
    if isinstance(entry, str):
        return None if entry in (DATA, REPLICA) else entry
    if isinstance(entry, tuple):
        return tuple(a for a in entry if a not in (DATA, REPLICA)) or None
    return entry


def drop_own_axes(spec: P | None) -> P | None:
    """``spec`` with ``data`` and ``replica`` removed from every entry."""
    return None if spec is None else P(*(_drop_own_axes(e) for e in spec))


def to_mesh_axes(name: str, logical: Sequence[Any] | None, rules: tuple[Rule, ...]) -> P | None:
    """The mesh spec of parameter ``name`` (for errors) whose dimensions are named
    ``logical``, by Flax's rule mapping, without jzero's own axes."""
    if logical is None:
        return None
    try:
        spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    except ValueError as e:
        raise ValueError(f"param {name}: can't map logical axes {tuple(logical)}: {e}") from None
    return drop_own_axes(spec)


def logical_to_mesh(specs: Any, rules: tuple[Rule, ...]) -> Any:
    """A tree (or tree prefix) of logical ``PartitionSpec`` s mapped to mesh specs."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: to_mesh_axes(jax.tree_util.keystr(path), s, rules),
        specs,
        is_leaf=_is_spec,
    )


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


def user_specs(shapes: Any, mesh: Mesh, param_specs: Any, rules: Rules | None) -> Any:
    """The specs over the mesh's other axes, per parameter leaf of ``shapes`` (``P()``:
    none): ``param_specs`` (logical names mapped by ``rules`` when given), else with
    ``rules`` alone the parameters' own Flax metadata, else none. A ``data`` axis the
    metadata names is left to jzero; one in ``param_specs`` is refused."""
    if param_specs is None and rules is None:
        return jax.tree.map(lambda _: P(), shapes)
    if param_specs is None:
        specs = _metadata_specs(shapes, mesh, rules)
    else:
        specs = _given_specs(shapes, param_specs, rules)
    return fit_specs(shapes, specs, mesh, drop_data=param_specs is None)


def _given_specs(shapes: Any, param_specs: Any, rules: Rules | None) -> Any:
    """``param_specs`` checked against the parameter tree, mapped by ``rules`` if any."""
    try:
        jax.tree.broadcast(param_specs, shapes, is_leaf=lambda x: isinstance(x, P))
    except ValueError as e:
        raise ValueError(
            f"param_specs does not match the parameter tree ({e}); give a PartitionSpec "
            "per parameter leaf, or a prefix of the tree."
        ) from None
    return param_specs if rules is None else logical_to_mesh(param_specs, rules)


def _metadata_specs(shapes: Any, mesh: Mesh, rules: Rules) -> Any:
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
    return jax.tree.unflatten(jax.tree.structure(shapes), specs)
