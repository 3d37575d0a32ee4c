"""The device mesh: jzero partitions along its ``data`` axis and leaves other axes alone.

An optional ``replica`` axis makes the run *hybrid* (FSDP2's HSDP, ZeRO++'s hpZ, MiCS):
model states are sharded within a ``data`` group (e.g. one host's devices, fast links)
and replicated across the ``replica`` groups (slow links); the batch is split over both.

Axes may be of any type JAX builds meshes with: ``Auto`` (:func:`data_mesh`,
:func:`hybrid_mesh`), ``Explicit`` (``jax.make_mesh``'s default, often under
``jax.set_mesh``) or a mix. jzero computes on the mesh's ``Auto`` twin and returns arrays
typed with the mesh given (:mod:`.axis_types`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"
"""Name of the mesh axis that jzero partitions model states along."""

REPLICA = "replica"
"""Name of the optional mesh axis that model states are replicated across (hybrid sharding):
the batch is split over ``(replica, data)`` and gradient shards are all-reduced across it."""

logger = logging.getLogger("jzero")

ONE_CPU_HINT = (
    "only one CPU device: jzero will train on one device. For N CPU devices call "
    'jax.config.update("jax_num_cpu_devices", N) before JAX touches a device (or set '
    "XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)."
)


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over ``devices`` (default: all devices) named ``'data'``.

    It logs the mesh it built (logger ``"jzero"``, level INFO), and a WARNING with the fix
    when the only device is one CPU (jzero would then train on one device).

    The axis is ``AxisType.Auto``. A mesh from ``jax.make_mesh`` (``Explicit`` axes) works
    the same: jzero computes on an ``Auto`` twin of it and returns arrays typed with it
    (:mod:`jzero.core.axis_types`).

    Examples:
        >>> mesh = jzero.data_mesh()
        >>> mesh.shape['data'] == jax.device_count()
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("data_mesh() got an empty device list; pass at least one jax.Device.")
    mesh = Mesh(np.array(devices), (DATA,), axis_types=(AxisType.Auto,))
    kinds = sorted({d.platform for d in devices})
    logger.info("jzero.data_mesh: 'data' axis over %d %s device(s)", len(devices), "/".join(kinds))
    if len(devices) == 1 and kinds == ["cpu"] and jax.device_count() == 1:
        logger.warning("jzero.data_mesh: %s", ONE_CPU_HINT)
    return mesh


def hybrid_mesh(replicas: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``('replica', 'data')`` mesh: ``replicas`` groups of ``len(devices) // replicas``.

    Model states are sharded over each group's ``data`` axis and replicated across the
    groups (hybrid sharding, HSDP). Consecutive devices (default: ``jax.devices()``, which
    lists each host's devices together) form a group, so put one host's devices in one
    group: its collectives use the fast links, and only the gradient shards cross hosts.

    Examples:
        >>> mesh = jzero.hybrid_mesh(2)  # 8 devices: 2 replicas x 4
        >>> dict(mesh.shape)
        {'replica': 2, 'data': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}.")
    if not devices or len(devices) % replicas:
        raise ValueError(
            f"hybrid_mesh({replicas}) needs a device count divisible by {replicas}, got "
            f"{len(devices)} device(s); pass a number of replicas that divides it."
        )
    grid = np.array(devices).reshape(replicas, len(devices) // replicas)
    mesh = Mesh(grid, (REPLICA, DATA), axis_types=(AxisType.Auto, AxisType.Auto))
    logger.info("jzero.hybrid_mesh: %d replica(s) x 'data' groups of %d device(s)", *grid.shape)
    return mesh


def check_mesh(mesh: Mesh) -> int:
    """Validates ``mesh`` for jzero and returns the size of its ``data`` axis.

    Its axes may be ``Auto`` or ``Explicit`` (:mod:`.axis_types`); ``Manual`` axes, the
    type ``shard_map`` gives axes inside its body, are refused."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            "build one with jzero.data_mesh() or jax.make_mesh(..., ('data', ...))."
        )
    if DATA not in mesh.axis_names and REPLICA in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names}: a {REPLICA!r} axis but no {DATA!r} axis. Hybrid "
            f"sharding shards model states within a {DATA!r} group and replicates them across "
            f"{REPLICA!r}; build the mesh with jzero.hybrid_mesh(replicas) or "
            "jax.make_mesh((r, g), ('replica', 'data'))."
        )
    if DATA not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names} but no {DATA!r} axis, which jzero partitions along; "
            "use jzero.data_mesh() or name one axis 'data', e.g. "
            "jax.make_mesh((n, m), ('data', 'model'))."
        )
    manual = [n for n, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Manual]
    if manual:
        raise ValueError(
            f"mesh axes {manual} are AxisType.Manual, the type jax.shard_map gives axes inside "
            "its body; jzero runs its own shard_map. Pass the mesh with Auto or Explicit axes, "
            "e.g. jax.make_mesh(shape, names) or jzero.data_mesh()."
        )
    return mesh.shape[DATA]


def fit_specs(params: Any, specs: Any, mesh: Mesh, *, drop_data: bool = True) -> Any:
    """``specs`` over ``params``, checked against ``mesh``, with 'data' dropped (jzero adds
    it) or, if ``drop_data`` is False, refused."""
    is_spec = lambda x: isinstance(x, P) or x is None
    specs = jax.tree.leaves(jax.tree.broadcast(specs, params, is_leaf=is_spec), is_leaf=is_spec)
    out = []
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs):
        name, entries = jax.tree_util.keystr(path), []
        for dim, axes in enumerate(spec or ()):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            if REPLICA in axes:
                raise ValueError(
                    f"param {name}: the PartitionSpec {spec} names the {REPLICA!r} axis; "
                    f"model states are replicated across {REPLICA!r} (hybrid sharding). "
                    "Give specs over your other axes only (e.g. P(None, 'model'))."
                )
            if DATA in axes and not drop_data:
                raise ValueError(
                    f"param {name}: the PartitionSpec {spec} names the {DATA!r} axis; jzero "
                    "adds 'data' itself. Give specs over your other axes only (e.g. P(None, "
                    "'model'))."
                )
            axes, size = tuple(a for a in axes if a != DATA), 1
            for axis in axes:
                if axis not in mesh.shape:
                    raise ValueError(
                        f"param {name} is partitioned over mesh axis {axis!r} ({spec}), but the "
                        f"mesh has axes {dict(mesh.shape)}; add a {axis!r} axis to the mesh, "
                        f"e.g. jax.make_mesh((n, m), ('data', {axis!r})), or drop it from the "
                        f"spec. If {axis!r} is a logical axis name (nn.with_logical_partitioning), "
                        f"map it to mesh axes with rules=, e.g. rules=(({axis!r}, 'model'), ...) "
                        f"or (({axis!r}, None), ...) to replicate it."
                    )
                size *= mesh.shape[axis]
            if x.shape[dim] % size:
                raise ValueError(
                    f"param {name} has shape {tuple(x.shape)}; dim {dim} ({x.shape[dim]}) is "
                    f"partitioned over mesh axes {axes} of size {size}, which does not divide it; "
                    "use mesh axis sizes that divide it, or change the layer size."
                )
            entries.append(axes[0] if len(axes) == 1 else (axes or None))
        out.append(P(*entries))
    return jax.tree.unflatten(jax.tree.structure(params), out)


# Stage 3 in the user's own step: parameters gathered where the loss uses them. Given only
# the parameters' sharded layout, the partitioner may keep a weight sharded and reshard the
# activations around it instead; constraining each layer's parameters whole where it uses
# them makes it gather them, one layer at a time inside a scan: ZeRO-3's schedule.


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
