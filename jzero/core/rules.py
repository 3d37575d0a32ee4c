"""Logical axis rules: parameter specs named by logical axes, mapped to the mesh's axes.

Models annotated with ``nn.with_logical_partitioning`` (lm1b, MaxText-style models) name
their dimensions logically (``('embed', 'mlp')``); ``rules`` -- pairs ``(logical_name,
mesh_axes)`` as ``nn.logical_axis_rules`` takes them -- say which mesh axes each name is
split over. The mapping is Flax's own (:func:`flax.linen.logical_to_mesh_axes`): rules in
order of precedence, each mesh axis used once per array, a name with no rule replicated.

jzero's own axes are then dropped from the result: ``data`` (jzero places it by its layout
rule, so an FSDP rule such as ``('embed', 'data')`` kept from a pjit setup gives that
dimension back to jzero) and ``replica`` (model states are replicated across it). What is
left is a spec over the mesh's other axes, treated exactly as an explicit ``param_specs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .mesh import DATA, REPLICA

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
    from flax.linen import logical_to_mesh_axes  # Flax's rule semantics; linen is heavy

    if logical is None:
        return None
    try:
        spec = logical_to_mesh_axes(tuple(logical), rules)
    except ValueError as e:
        raise ValueError(f"param {name}: can't map logical axes {tuple(logical)}: {e}") from None
    return drop_own_axes(spec)


def logical_to_mesh(specs: Any, rules: tuple[Rule, ...]) -> Any:
    """A tree (or tree prefix) of logical ``PartitionSpec`` s mapped to mesh specs."""
    is_spec = lambda x: isinstance(x, P) or x is None
    return jax.tree_util.tree_map_with_path(
        lambda path, s: to_mesh_axes(jax.tree_util.keystr(path), s, rules),
        specs,
        is_leaf=is_spec,
    )
