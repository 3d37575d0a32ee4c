"""Which collective of a function names a mesh axis that a step does not have.

Inside ``jax.shard_map``, ``lax.psum(x, 'batch')`` on a mesh without ``'batch'`` fails in
JAX's ``pvary`` with a bare ``AssertionError`` (``all_gather`` / ``axis_index`` with a
``NameError``), neither naming the collective. :func:`unbound_axes` finds out by tracing
the function again on its own: in a ``shard_map`` over an abstract mesh of the known axes
without JAX's varying-axes checks, where a collective over a name the mesh lacks raises
``NameError('... unbound axis name: NAME ...')``; each such name is added to the mesh (size
1) and the trace repeated until it succeeds, and the collectives naming the added axes
are read from the resulting jaxpr.

:func:`vmapped_collectives` reads the same trace for collectives over an axis the function
binds itself with ``jax.vmap(..., axis_name=...)``: without the checks, vmap turns them
into collectives over array positions (``psum[axes=(0,)]``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from .equation import walk

_UNBOUND = re.compile(r"unbound axis name: (.+?)(?:\. To fix this|$)")
"""How JAX's ``NameError`` for an axis missing from the mesh names it."""

_MOST_UNKNOWN = 16  # axis names one diagnosis adds before it gives up


class Unbound(NamedTuple):
    """A collective over an axis the step does not have."""

    axis: str
    collective: str  # the jax.lax function, e.g. 'all_gather' or 'psum/pmean'
    where: str  # the source line that called it, 'file:line (function)'; '' if unknown


def unbound_axes(
    fn: Callable[..., Any], args: Sequence[Any], axis_sizes: Mapping[str, int]
) -> list[Unbound]:
    """The collectives in ``fn(*args)`` over axes not in ``axis_sizes`` (the step's mesh
    axes and aliases, with their sizes), first use first; empty when there are none, or
    when ``fn`` cannot be traced here for another reason."""
    try:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), args)
    except Exception:  # noqa: BLE001 -- an argument without shape/dtype: no diagnosis
        return []
    sizes = dict(axis_sizes)
    for _ in range(_MOST_UNKNOWN):
        try:
            traced = _trace(fn, abstract, sizes)
        except NameError as e:
            found = _UNBOUND.search(str(e))
            if found is None or found.group(1) in sizes:
                return []
            sizes[found.group(1)] = 1
            continue
        except Exception:  # noqa: BLE001 -- fails here for another reason: no diagnosis
            return []
        unknown = set(sizes) - set(axis_sizes)
        return [
            Unbound(name, eqn.api_name, eqn.where)
            for eqn in walk(traced)
            for name in sorted(eqn.axis_names & unknown)
        ]
    return []


def vmapped_collectives(
    fn: Callable[..., Any], args: Sequence[Any], axis_sizes: Mapping[str, int]
) -> list[Unbound]:
    """The collectives in ``fn(*args)`` over an axis bound by a ``jax.vmap`` inside ``fn``
    (``axis`` is '' since vmap leaves no name behind), first use first; empty when there
    are none, or when ``fn`` cannot be traced here."""
    try:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), args)
        traced = _trace(fn, abstract, dict(axis_sizes))
    except Exception:  # noqa: BLE001 -- fails here for another reason: no diagnosis
        return []
    return [
        Unbound("", eqn.api_name, eqn.where)
        for eqn in walk(traced)
        if eqn.api_name in _COLLECTIVE_NAMES and _positions(eqn.axes)
    ]


_COLLECTIVE_NAMES = frozenset({"psum/pmean", "pmax", "pmin"})
"""The reductions vmap turns into reductions over positions."""


def _positions(axes: Any) -> bool:
    return isinstance(axes, tuple | list) and any(isinstance(a, int) for a in axes)


def _trace(fn: Callable[..., Any], args: Sequence[Any], sizes: dict[str, int]) -> Any:
    """``fn`` traced inside a ``shard_map`` over every axis in ``sizes``, replicated
    inputs, and no varying-axes checks (so that an unbound name raises a ``NameError``)."""
    mesh = AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Explicit,) * len(sizes)
    )

    def arrays_out(*a: Any) -> list:
        return [x for x in jax.tree.leaves(fn(*a)) if isinstance(x, jax.Array)]

    mapped = jax.shard_map(arrays_out, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    # Out of the caller's mesh first: a mesh of another size cannot replace it directly.
    none = AbstractMesh((), ())
    with jax.sharding.use_abstract_mesh(none), jax.sharding.use_abstract_mesh(mesh):
        return jax.make_jaxpr(mapped)(*args)
