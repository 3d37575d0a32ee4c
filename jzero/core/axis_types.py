"""Meshes of any axis types: jzero computes on the mesh's ``Auto`` twin.

JAX types each mesh axis ``Auto``, ``Explicit`` or ``Manual``. ``jax.make_mesh`` gives
``Explicit`` axes, which put shardings in the arrays' types: ordinary Optax code then
fails where it contracts over a sharded dimension (Muon's Newton-Schulz matmuls raise
``ShardingTypeError``), and so do slicing and padding a sharded dimension (jzero's
padding). So every jitted program of jzero runs on the *compute mesh*
(:func:`compute_mesh`): the user's mesh with every axis ``Auto`` -- the same devices,
names and shape. :func:`on_compute_mesh` retypes a program's inputs onto it and, while
the program traces, puts it in place of any mesh the caller set with ``jax.set_mesh``;
the program's results are typed with the user's mesh again, by ``out_shardings``
on that mesh or by :func:`typed`. Both retypings change types only: the devices and
specs are the same, so no data moves and the compiled collectives are those of an
``Auto`` mesh. On a mesh whose axes are all ``Auto`` nothing is retyped.

The loss runs on the compute mesh too (in the step's ``shard_map``), so a model written
for ``Auto`` axes runs unchanged; code in it that needs ``Explicit`` types, such as
``jax.sharding.reshard`` to a spec naming a mesh axis (e.g. ``'model'``), raises JAX's
"cannot contain axis names that are of type Auto" error there: constrain with
``jax.lax.with_sharding_constraint`` instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def is_auto(mesh: Any) -> bool:
    """Whether every axis of ``mesh`` (a ``Mesh`` or ``AbstractMesh``) is ``Auto``."""
    return all(kind == AxisType.Auto for kind in mesh.axis_types)


def compute_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``AxisType.Auto`` (``mesh`` itself when it already is)."""
    if is_auto(mesh):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def on_compute_mesh(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """``fn`` (to be traced under ``jit``) run on :func:`compute_mesh` of ``mesh``.

    Array arguments typed with non-``Auto`` axes (e.g. a state or batch on the user's
    ``Explicit`` mesh) are retyped onto the compute mesh, and while ``fn`` traces the
    ambient mesh is the compute mesh unless none is set (as with a plain ``jit``).
    """
    twin = compute_mesh(mesh)

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        ambient = jax.sharding.get_abstract_mesh()
        if not ambient.empty and ambient.size != twin.size:
            raise ValueError(
                f"this jzero optimizer was built for a mesh of {twin.size} devices "
                f"({dict(mesh.shape)}), but it runs under jax.set_mesh of a mesh of "
                f"{ambient.size} ({dict(ambient.shape)}); build it with the mesh you train "
                "under (e.g. jzero.shard_optimizer(tx, mesh) with that mesh), or call it "
                "outside the other mesh's context."
            )
        args = jax.tree.map(lambda x: _retype_in(x, twin), args)
        if ambient.empty or ambient == twin.abstract_mesh:
            return fn(*args)
        with jax.sharding.use_abstract_mesh(twin.abstract_mesh):
            return fn(*args)

    return traced


def _retype_in(x: Any, twin: Mesh) -> Any:
    if not isinstance(x, jax.Array) or is_auto(jax.typeof(x).sharding.mesh):
        return x
    return jax.sharding.reshard(x, NamedSharding(twin, P()))


def typed(tree: Any, shardings: Any) -> Any:
    """Inside ``jit``: ``tree``'s leaves typed with ``shardings`` (a matching tree of
    ``NamedSharding`` s on the user's mesh), which their values already have on the
    compute mesh. Leaves on a mesh of ``Auto`` axes are returned as they are."""

    def retype(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        if is_auto(sharding.mesh):
            return x
        spec = explicit_spec(sharding.spec, sharding.mesh)
        return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(retype, tree, shardings)


def explicit_spec(spec: P, mesh: Mesh) -> P:
    """``spec`` with only ``mesh``'s ``Explicit`` axes (the part that is a type)."""
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    keep = lambda axes: tuple(a for a in axes if kinds[a] == AxisType.Explicit)
    entries = []
    for axes in spec:
        axes = keep((axes,) if isinstance(axes, str) else tuple(axes or ()))
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries)
