"""The plan: the one description of where every leaf of a run's state lives.

A :class:`Plan` is static and hashable. It holds the mesh, the ZeRO stage as data (which
model states are partitioned over ``data``: optimizer state from stage 1, gradients from
stage 2, parameters at stage 3) and, per stored leaf, a :class:`Stored`: its layout (shard
dimension, padding, ``PartitionSpec``), whether it is stored partitioned, its dtype and its
memory kind. On a mesh with a ``replica`` axis (hybrid sharding) every layout and spec
still names ``data`` only, so each stored leaf is replicated across ``replica``; the plan
records the replica count and the axes the batch is split over. Everything else -- the
step, init, export, accounting -- reads placement from here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._table import table
from .leaf_layout import LeafLayout, leaf_layout
from .mesh import DATA, REPLICA
from .mesh_types import compute_mesh
from .offload.options import DEFAULT_OFFLOAD_CHUNK as DEFAULT_OFFLOAD_CHUNK
from .offload.options import HOST as HOST
from .offload.options import NO_OFFLOAD, Offload

Stage = Literal[0, 1, 2, 3]


@dataclasses.dataclass(frozen=True)
class Stored:
    """How one leaf is stored at rest (static metadata, not a pytree node).

    Attributes:
        layout: the leaf's :class:`LeafLayout` (true shape, shard dimension, padding).
        partitioned: stored as 1/N shards along ``layout.dim``, padded; otherwise whole,
            true shape, replicated over ``data``.
        dtype: the stored dtype.
        memory_kind: the ``NamedSharding`` memory kind; None: the device's default memory.
    """

    layout: LeafLayout
    partitioned: bool
    dtype: np.dtype
    memory_kind: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored (global) shape."""
        return self.layout.padded if self.partitioned else self.layout.shape

    @property
    def spec(self) -> P:
        """The stored array's ``PartitionSpec``, the user's other mesh axes included."""
        return self.layout.spec if self.partitioned else self.layout.user_spec

    @property
    def data_spec(self) -> P:
        """The stored spec restricted to ``data`` (what ``shard_map`` sees)."""
        return self.layout.data_spec() if self.partitioned else P()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Placement of a run's parameters, optimizer state and fp32 master weights.

    Attributes:
        mesh: the device mesh as the user gave it, of any axis types (its ``data`` axis is
            the one partitioned along); the stored leaves are typed with it, and jzero's
            programs compute on :attr:`compute_mesh`.
        stage: the ZeRO stage, 0 to 3; ``partitions_*`` say what it means.
        params_def, params: treedef and per-leaf :class:`Stored` of the parameters.
        opt_def, opt: the same for the Optax state.
        master: per parameter leaf, the fp32 master weights' :class:`Stored` when the
            parameters are stored in a 16-bit dtype; None otherwise.
        offload: what rests in host memory and where the optimizer step runs
            (:class:`Offload`; ``Offload()``: nothing offloaded).
    """

    mesh: Mesh
    stage: int
    params_def: Any
    params: tuple[Stored, ...]
    opt_def: Any
    opt: tuple[Stored, ...]
    master: tuple[Stored, ...] | None
    offload: Offload = NO_OFFLOAD

    @property
    def data_size(self) -> int:
        """G: the devices of one ``data`` group, which model states are sharded over."""
        return self.mesh.shape[DATA]

    @property
    def hybrid(self) -> bool:
        """The mesh has a ``replica`` axis: model states are replicated across it (HSDP)."""
        return REPLICA in self.mesh.axis_names

    @property
    def replica_size(self) -> int:
        """R: the ``data`` groups holding a copy of every model state; 1 if not hybrid."""
        return self.mesh.shape[REPLICA] if self.hybrid else 1

    @property
    def dp_size(self) -> int:
        """R·G: the data-parallel degree, the devices the batch is split over."""
        return self.replica_size * self.data_size

    @property
    def manual_axes(self) -> frozenset[str]:
        """The mesh axes the step's ``shard_map`` is manual over (others are left to XLA)."""
        return frozenset({DATA, REPLICA}) if self.hybrid else frozenset({DATA})

    @property
    def batch_axes(self) -> str | tuple[str, ...]:
        """The axes the batch is split over, and losses and model states averaged over."""
        return (REPLICA, DATA) if self.hybrid else DATA

    @property
    def partitions_opt_state(self) -> bool:
        """Stage >= 1 (P_os): the optimizer state and master weights are 1/N shards."""
        return self.stage >= 1

    @property
    def partitions_grads(self) -> bool:
        """Stage >= 2 (P_g): gradients are reduce-scattered during backward, never whole."""
        return self.stage >= 2

    @property
    def partitions_params(self) -> bool:
        """Stage 3 (P_p): parameters at rest are 1/N shards, gathered where used."""
        return self.stage == 3

    @property
    def layouts(self) -> tuple[LeafLayout, ...]:
        """The parameters' layouts, flat."""
        return tuple(s.layout for s in self.params)

    @property
    def opt_layouts(self) -> tuple[LeafLayout, ...]:
        """The optimizer state's layouts, flat."""
        return tuple(s.layout for s in self.opt)

    @property
    def offloads(self) -> bool:
        """Whether the optimizer state and master weights rest in host memory (``HOST``)."""
        return self.offload.optimizer is not None

    @property
    def offloads_params(self) -> bool:
        """Whether stage 3's parameter shards rest in host memory (``HOST``)."""
        return any(s.memory_kind == HOST for s in self.params)

    @property
    def host_step(self) -> bool:
        """Whether the optimizer step runs on the host (``Offload(optimizer="host")``)."""
        return self.offload.optimizer == "host"

    @property
    def offload_chunk(self) -> int | None:
        """With a streamed optimizer, the most elements of a leaf whose elementwise update
        streams through the device at once (:mod:`.offload.chunks`); None otherwise."""
        return self.offload.stream_chunk

    def params_tree(self) -> Any:
        """The parameters' :class:`LeafLayout` s as a pytree shaped like the parameters."""
        return jax.tree.unflatten(self.params_def, self.layouts)

    def opt_tree(self) -> Any:
        """The optimizer state's :class:`LeafLayout` s, shaped like the Optax state."""
        return jax.tree.unflatten(self.opt_def, self.opt_layouts)

    @property
    def compute_mesh(self) -> Mesh:
        """The mesh jzero's programs compute on: ``mesh`` with every axis ``Auto``
        (:mod:`.mesh_types`)."""
        return compute_mesh(self.mesh)

    def sharding(self, stored: Stored | P) -> NamedSharding:
        """The ``NamedSharding`` of a stored leaf (or of a spec) on ``mesh``: the leaf at
        rest, as init, the step and export return it."""
        return _named(self.mesh, stored)

    def compute_sharding(self, stored: Stored | P) -> NamedSharding:
        """:meth:`sharding` on :attr:`compute_mesh`: what programs constrain leaves to."""
        return _named(self.compute_mesh, stored)

    def shardings(self, stored: tuple[Stored, ...], treedef: Any) -> Any:
        return jax.tree.unflatten(treedef, [self.sharding(s) for s in stored])

    def describe(self) -> str:
        """A readable table: one row per parameter leaf with its layout; with offload, the
        memory each leaf (and its master weights) rests in, and the optimizer state's."""
        paths = [jax.tree_util.keystr(k) for k, _ in _paths(self.params_def)]
        offloaded = self.offloads or self.offloads_params
        kind = lambda stored: stored.memory_kind or "device"
        head = ("leaf", "shape", "shard dim", "stored", "pad", "spec")
        extra = ("memory", "master memory") if self.master else ("memory",)
        rows = [head + extra if offloaded else head]
        for i, (path, lay) in enumerate(zip(paths, self.layouts)):
            dim = "-" if lay.dim is None else str(lay.dim)
            row = (path, str(lay.shape), dim, str(lay.padded), str(lay.pad), str(lay.spec))
            kinds = (kind(self.params[i]),) + ((kind(self.master[i]),) if self.master else ())
            rows.append(row + kinds if offloaded else row)
        if not offloaded:
            return table(rows)
        opt_kinds = sorted({kind(s) for s in self.opt})
        return f"{table(rows)}\noptimizer state in {', '.join(opt_kinds) or '-'}"


def _named(mesh: Mesh, stored: Stored | P) -> NamedSharding:
    if isinstance(stored, P):
        return NamedSharding(mesh, stored)
    return NamedSharding(mesh, stored.spec, memory_kind=stored.memory_kind)


def _paths(treedef: Any) -> list[tuple[Any, Any]]:
    dummy = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return jax.tree_util.tree_flatten_with_path(dummy)[0]


def make_plan(
    *,
    mesh: Mesh,
    stage: int,
    params: Any,
    opt_state: Any,
    user_specs: Any,
    min_shard_size: int,
    param_dtype: Any,
    offload: Offload = NO_OFFLOAD,
    owners: list[int] | None = None,
) -> Plan:
    """Lays out ``params`` and ``opt_state`` (``jax.ShapeDtypeStruct`` trees) for ``stage``.

    Each leaf is laid out by its shape (:func:`leaf_layout`). An optimizer-state leaf takes
    the user spec of the parameter it belongs to, ``owners[k]`` for leaf k (as
    :func:`.param_owners.param_owners` reads it from Optax), when it has that parameter's
    shape; other leaves get none. Without ``owners`` (Optax could not tell), a leaf takes
    the spec of the one parameter of its shape, if only one has it. ``user_specs`` is a tree
    of ``PartitionSpec`` over the mesh's other axes, shaped like ``params``. Parameters are
    stored in ``param_dtype``; with a 16-bit ``param_dtype`` the fp32 master weights are
    laid out like the optimizer state. With ``offload.optimizer`` the optimizer state and
    master weights are stored in host memory (memory kind ``HOST``); the parameters stay on
    the device.
    """
    n = 1 if stage == 0 else mesh.shape[DATA]
    rule = lambda x, spec: leaf_layout(x.shape, n, min_shard_size=min_shard_size, user_spec=spec)
    p_leaves, p_def = jax.tree.flatten(params)
    p_lays = [rule(x, s) for x, s in zip(p_leaves, jax.tree.leaves(user_specs))]
    o_leaves, o_def = jax.tree.flatten(opt_state)
    specs = _opt_specs(p_lays, [tuple(int(s) for s in x.shape) for x in o_leaves], owners)
    o_lays = [rule(x, spec) for x, spec in zip(o_leaves, specs)]

    param_dtype = np.dtype(param_dtype)
    mixed = param_dtype != np.dtype(np.float32)
    floating = lambda x: jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    stored_dtype = lambda x: param_dtype if floating(x) else np.dtype(x.dtype)
    kind = HOST if offload.optimizer is not None else None
    params_stored = tuple(
        Stored(lay, stage == 3, stored_dtype(x)) for lay, x in zip(p_lays, p_leaves)
    )
    opt_stored = tuple(
        Stored(lay, stage >= 1, np.dtype(x.dtype), kind) for lay, x in zip(o_lays, o_leaves)
    )
    master = None
    if mixed:
        master = tuple(
            Stored(lay, stage >= 1, np.dtype(np.float32 if floating(x) else x.dtype), kind)
            for lay, x in zip(p_lays, p_leaves)
        )
    plan = Plan(mesh, stage, p_def, params_stored, o_def, opt_stored, master, offload)
    return params_offloaded(plan) if offload.params else plan


def params_offloaded(plan: Plan) -> Plan:
    """``plan`` with stage 3's sharded parameter leaves, and their fp32 master weights, in
    host memory (``HOST``): ZeRO-Infinity's parameter offload. Leaves too small to be
    sharded stay on the device, whole (as DeepSpeed keeps parameters below its persistence
    threshold), and so does the Optax state unless the optimizer is offloaded too."""
    sharded = [s.layout.sharded for s in plan.params]
    host = lambda s, on: dataclasses.replace(s, memory_kind=HOST) if on else s
    params = tuple(host(s, on) for s, on in zip(plan.params, sharded))
    master = plan.master and tuple(host(s, on) for s, on in zip(plan.master, sharded))
    return dataclasses.replace(plan, params=params, master=master)


def _opt_specs(p_lays: list, shapes: list[tuple[int, ...]], owners: list[int] | None) -> list:
    """The user spec of each optimizer-state leaf: its owner's where it has the owner's
    shape (by shape alone, where unambiguous, when ``owners`` is None); else ``P()``."""
    if owners is not None:
        spec = lambda k, shape: p_lays[k].user_spec if k >= 0 and p_lays[k].shape == shape else P()
        return [spec(k, shape) for k, shape in zip(owners, shapes)]
    by_shape: dict[tuple[int, ...], set[P]] = {}
    for lay in p_lays:
        by_shape.setdefault(lay.shape, set()).add(lay.user_spec)
    return [next(iter(by_shape[s])) if len(by_shape.get(s, ())) == 1 else P() for s in shapes]
