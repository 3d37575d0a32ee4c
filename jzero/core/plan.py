"""The plan: the one description of where every leaf of a run's state lives.

A :class:`Plan` is static and hashable. It holds the mesh, the run's configuration (the
ZeRO stage says which model states are partitioned over ``data``: optimizer state from
stage 1, gradients from stage 2, parameters at stage 3) and, per stored leaf, a
:class:`Stored`: its layout (shard dimension, padding, ``PartitionSpec``), whether it is
stored partitioned, its dtype and its memory kind. On a mesh with a ``replica`` axis
(hybrid sharding) every layout and spec still names ``data`` only, so each stored leaf is
replicated across ``replica``; the plan records the replica count and the axes the batch is
split over. Everything else -- the step, init, export, accounting -- reads placement from
here and nowhere else. :class:`ZeroState` is the state laid out by a plan, carrying it.

:func:`param_owners`: which parameter each Optax-state leaf belongs to, as Optax itself
says (``optax.tree_map_params``), so that a moment takes its own parameter's spec; matching
by shape instead would give two same-shaped parameters with different specs the same
layout for their moments.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._table import table
from .axis_types import compute_mesh
from .leaf_layout import LeafLayout, leaf_layout
from .mesh import DATA, REPLICA
from .options.layout import Layout
from .options.offload import HOST, Offload, offloaded_leaves
from .options.precision import LossScale, Precision
from .options.step import StepOptions
from .options.zero_config import ZeroConfig
from .update_layout import MatrixUpdate, UpdateAxes, matrix_update


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
        config: the :class:`ZeroConfig` the leaves were laid out for: its stage,
            precision, communication and offload. Its layout and step options are left at
            their defaults: the leaves record the layout (each :class:`Stored`'s spec),
            however it was spelled, and each step brings its own options.
        params_def, params: treedef and per-leaf :class:`Stored` of the parameters.
        opt_def, opt: the same for the Optax state.
        master: per parameter leaf, the fp32 master weights' :class:`Stored` when the
            parameters are stored in a 16-bit dtype; None otherwise.
        matrices: which axes the Optax update mixes per leaf (Muon's Newton-Schulz), read
            from its jaxpr, and where such leaves are updated on whole matrices
            (:class:`.update_layout.MatrixUpdate`); None where the update could not be read.
    """

    mesh: Mesh
    config: ZeroConfig
    params_def: Any
    params: tuple[Stored, ...]
    opt_def: Any
    opt: tuple[Stored, ...]
    master: tuple[Stored, ...] | None
    matrices: MatrixUpdate | None = None

    @property
    def owner_layouts(self) -> tuple[LeafLayout | None, ...]:
        """Per parameter leaf, its owner layout (:attr:`matrices`), or None."""
        return self.matrices.layouts if self.matrices else (None,) * len(self.params)

    @property
    def update_layouts(self) -> tuple[LeafLayout, ...]:
        """Per parameter leaf, the layout its update runs in: its owner layout where it has
        one, else its stored layout."""
        return tuple(o or s.layout for o, s in zip(self.owner_layouts, self.params))

    @property
    def stage(self) -> int:
        """The ZeRO stage the leaves are laid out for (``config.stage``)."""
        return self.config.stage

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
    def layouts(self) -> tuple[LeafLayout, ...]:
        """The parameters' layouts, flat."""
        return tuple(s.layout for s in self.params)

    @property
    def opt_layouts(self) -> tuple[LeafLayout, ...]:
        """The optimizer state's layouts, flat."""
        return tuple(s.layout for s in self.opt)

    @property
    def pending(self) -> tuple[Stored, ...] | None:
        """With ``Offload(delay=1)``: per parameter leaf, how the reduced gradient a step
        holds for the next one rests (stored shards, the reduce dtype, host memory, as
        ZeRO-Offload keeps gradients on the CPU); None otherwise."""
        if not self.config.offload.delay:
            return None
        dtype = np.dtype(self.config.precision.reduce_dtype)
        return tuple(dataclasses.replace(s, dtype=dtype, memory_kind=HOST) for s in self.opt_like)

    @property
    def offloaded(self) -> tuple[bool, ...]:
        """Per parameter leaf, whether its optimizer state and master weights rest in host
        memory (``Offload.ratio``'s share of the leaves, :func:`offloaded_leaves`; none
        without an offloaded optimizer)."""
        offload = self.config.offload
        if offload.optimizer is None:
            return (False,) * len(self.params)
        return tuple(
            offloaded_leaves([math.prod(lay.shape) for lay in self.layouts], offload.ratio)
        )

    @property
    def opt_like(self) -> tuple[Stored, ...]:
        """Per parameter leaf, its layout as the optimizer state stores it (partitioned from
        stage 1), in the parameters' dtype, on the device."""
        partitioned = self.config.partitions_opt_state
        return tuple(Stored(s.layout, partitioned, s.dtype) for s in self.params)

    @property
    def offloads_params(self) -> bool:
        """Whether any of stage 3's parameter shards rests in host memory (``HOST``)."""
        return any(s.memory_kind == HOST for s in self.params)

    def params_tree(self) -> Any:
        """The parameters' :class:`LeafLayout` s as a pytree shaped like the parameters."""
        return jax.tree.unflatten(self.params_def, self.layouts)

    def opt_tree(self) -> Any:
        """The optimizer state's :class:`LeafLayout` s, shaped like the Optax state."""
        return jax.tree.unflatten(self.opt_def, self.opt_layouts)

    @property
    def compute_mesh(self) -> Mesh:
        """The mesh jzero's programs compute on: ``mesh`` with every axis ``Auto``
        (:mod:`.axis_types`)."""
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

    def state_shardings(self, precision: Precision) -> ZeroState:
        """The ``NamedSharding`` of every leaf of a :class:`ZeroState` with this plan
        (``model_state``, replicated and of any structure, is placed by init, not listed)."""
        replicated = self.sharding(P())
        master = None
        if self.master is not None:
            master = self.shardings(self.master, self.params_def)
        loss_scale = None
        if precision.dynamic_loss_scale:
            loss_scale = LossScale(replicated, replicated)
        pending = None
        if self.pending is not None:
            pending = Pending(self.shardings(self.pending, self.params_def), replicated, replicated)
        return ZeroState(
            step=replicated,
            params=self.shardings(self.params, self.params_def),
            opt_state=self.shardings(self.opt, self.opt_def),
            model_state=None,
            master=master,
            loss_scale=loss_scale,
            plan=self,
            pending=pending,
        )

    def describe(self) -> str:
        """A readable table: one row per parameter leaf with its layout; with offload, the
        memory each leaf (and its master weights) rests in, and the optimizer state's."""
        paths = [jax.tree_util.keystr(k) for k, _ in _paths(self.params_def)]
        offloaded = self.config.offload.optimizer is not None or self.offloads_params
        kind = lambda stored: stored.memory_kind or "device"
        head = ("leaf", "shape", "shard dim", "stored", "pad", "spec", "update")
        extra = ("memory", "master memory") if self.master else ("memory",)
        rows = [head + extra if offloaded else head]
        for i, (path, lay) in enumerate(zip(paths, self.layouts)):
            dim = "-" if lay.dim is None else str(lay.dim)
            row = (path, str(lay.shape), dim, str(lay.padded), str(lay.pad), str(lay.spec))
            row += (self._update_column(i),)
            kinds = (kind(self.params[i]),) + ((kind(self.master[i]),) if self.master else ())
            rows.append(row + kinds if offloaded else row)
        if not offloaded:
            return table(rows)
        opt_kinds = sorted({kind(s) for s in self.opt})
        return f"{table(rows)}\noptimizer state in {', '.join(opt_kinds) or '-'}"

    def _update_column(self, i: int) -> str:
        """How leaf ``i`` is updated: elementwise ('-'), on whole matrices along an owner
        axis ('whole 1,2 by dim 0'), in a stack of its shape ('whole 0,1 in stack 0 (8
        leaves)') or, the only leaf of its shape, gathered ('whole 0,1 on every device');
        or mixing axes as the compiler splits it ('mixes 0,1'); '?' where the update could
        not be read."""
        if self.matrices is None:
            return "?"
        axes = ",".join(str(d) for d in sorted(self.matrices.mixed[i]))
        if not axes:
            return "-"
        owner, stack = self.matrices.layouts[i], self.matrices.stacks[i]
        if owner is not None:
            return f"whole {axes} by dim {owner.dim}"
        if stack is not None and self.matrices.stacks.count(stack) == 1:
            return f"whole {axes} on every device"
        if stack is not None:
            return f"whole {axes} in stack {stack} ({self.matrices.stacks.count(stack)} leaves)"
        return f"mixes {axes}"


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
    config: ZeroConfig,
    params: Any,
    opt_state: Any,
    user_specs: Any,
    owners: list[int] | None = None,
    axes: UpdateAxes | None = None,
) -> Plan:
    """Lays out ``params`` and ``opt_state`` (``jax.ShapeDtypeStruct`` trees) for ``config``.

    Each leaf is laid out by its shape (:func:`leaf_layout`, with the layout's
    ``min_shard_size``). An optimizer-state leaf takes the user spec of the parameter it
    belongs to, ``owners[k]`` for leaf k (as :func:`param_owners` reads it
    from Optax), when it has that parameter's shape; other leaves get none. Without
    ``owners`` (Optax could not tell), a leaf takes the spec of the one parameter of its
    shape, if only one has it. ``user_specs`` is a tree of ``PartitionSpec`` over the
    mesh's other axes, shaped like ``params``. Parameters are stored in the precision's
    ``param_dtype``; with a 16-bit one the fp32 master weights are laid out like the
    optimizer state. With ``offload.optimizer`` the optimizer state and master weights are
    stored in host memory (memory kind ``HOST``), those of ``offload.ratio``'s share of the
    parameter leaves; the parameters stay on the device. ``axes`` (per parameter leaf,
    the axes its update mixes, :func:`.update_layout.update_axes`) gives a mixing leaf its
    owner layout (:func:`.update_layout.owner_layout`) for its Optax state and master
    weights, from stage 1 and with the optimizer on the device.
    """
    stage, offload = config.stage, config.offload
    n = 1 if stage == 0 else mesh.shape[DATA]
    min_size = config.layout.min_shard_size

    def rule(x: Any, spec: Any) -> Any:  # typed PRNG keys stay whole: state, not weights
        m = 1 if is_key(x) else n
        return leaf_layout(x.shape, m, min_shard_size=min_size, user_spec=spec)

    p_leaves, p_def = jax.tree.flatten(params)
    p_lays = [rule(x, s) for x, s in zip(p_leaves, jax.tree.leaves(user_specs))]
    o_leaves, o_def = jax.tree.flatten(opt_state)
    specs = _opt_specs(p_lays, [tuple(int(s) for s in x.shape) for x in o_leaves], owners)
    o_lays = [rule(x, spec) for x, spec in zip(o_leaves, specs)]
    on_device = offload.optimizer is None and not offload.params
    matrices = axes and matrix_update(axes, p_lays, n, stage >= 1 and n > 1 and on_device)
    if matrices and not on_device and stage >= 1:
        _warn_split(matrices, p_lays, offload)
    owned = list(matrices.layouts) if matrices else [None] * len(p_lays)
    o_lays = _owned(o_lays, owned, axes.owners if axes else None)

    param_dtype = np.dtype(config.precision.param_dtype)
    floating = lambda x: jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    stored_dtype = lambda x: param_dtype if floating(x) else dtype_of(x)
    on_host = _offloaded(offload, [math.prod(lay.shape) for lay in p_lays], owners)
    kind = lambda i: HOST if on_host[i] else None  # i: parameter leaf, -1 none (e.g. a count)
    params_stored = tuple(
        Stored(lay, stage == 3, stored_dtype(x)) for lay, x in zip(p_lays, p_leaves)
    )
    o_kinds = [kind(k) for k in (owners or [-1] * len(o_leaves))]
    opt_stored = tuple(
        Stored(lay, stage >= 1, dtype_of(x), k) for lay, x, k in zip(o_lays, o_leaves, o_kinds)
    )
    master = None
    m_lays = [o or lay for o, lay in zip(owned, p_lays)]
    if config.precision.mixed:
        master = tuple(
            Stored(lay, stage >= 1, np.dtype(np.float32) if floating(x) else dtype_of(x), kind(i))
            for i, (lay, x) in enumerate(zip(m_lays, p_leaves))
        )
    # The layout is recorded in the leaves (each Stored's spec), however it was spelled;
    # each step brings its own options.
    laid_out = dataclasses.replace(config, layout=Layout(), step=StepOptions())
    plan = Plan(mesh, laid_out, p_def, params_stored, o_def, opt_stored, master, matrices)
    return params_offloaded(plan) if offload.params else plan


def _warn_split(matrices: MatrixUpdate, p_lays: list[LeafLayout], offload: Offload) -> None:
    """An offloaded optimizer updates where its state rests: a matrix optimizer's leaves
    are then updated split along their stored axis, as XLA partitions them (said once)."""
    split = [lay for lay, m in zip(p_lays, matrices.mixed) if lay.sharded and lay.dim in m]
    if split:
        warnings.warn(
            f"{offload} updates the optimizer state where it rests, so {len(split)} leaves "
            "whose update mixes the axis they are sharded along (a matrix optimizer such as "
            "Muon) are updated split along it, not on whole matrices: the compiler adds "
            "collectives inside the update (Muon: several times AdamW's bytes). jzero.report "
            "shows them; drop the offload to update them whole.",
            stacklevel=5,
        )


def _owned(o_lays: list, owned: list, owners: list[int] | None) -> list:
    """The optimizer-state layouts with each leaf of a parameter that has an owner layout
    (and of its shape) in that layout."""
    if not any(owned) or owners is None:
        return o_lays
    take = lambda k, lay: owned[k] if k >= 0 and owned[k] and owned[k].shape == lay.shape else lay
    return [take(k, lay) for k, lay in zip(owners, o_lays)]


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or shape) holds typed PRNG keys (``jax.random.key``)."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def dtype_of(x: Any) -> Any:
    """``x``'s dtype as stored: a NumPy dtype, or a typed key's own (NumPy has none)."""
    return x.dtype if is_key(x) else np.dtype(x.dtype)


COARSE_SPLIT = 0.1  # |share offloaded - Offload.ratio| above which the split is warned


def _offloaded(offload: Offload, sizes: list[int], owners: list[int] | None) -> dict[int, bool]:
    """Per parameter leaf (and -1: the Optax state no parameter owns, e.g. a count), whether
    its optimizer state and master weights rest in host memory (``Offload.ratio``'s share
    of the leaves; every one at ratio 1)."""
    if offload.optimizer is None:
        return dict.fromkeys(range(-1, len(sizes)), False)
    if offload.ratio != 1 and owners is None:
        raise ValueError(
            f"{offload} offloads the state of some parameters only, but Optax cannot say "
            "which parameter each optimizer-state leaf belongs to (optax.tree_map_params "
            "failed on this transformation); use ratio=1 (the whole state on the host)."
        )
    chosen = offloaded_leaves(sizes, offload.ratio)
    share = sum(n for n, on in zip(sizes, chosen) if on) / max(sum(sizes), 1)
    if abs(share - offload.ratio) > COARSE_SPLIT:
        warnings.warn(
            f"{offload} keeps the optimizer state of {share:.2f} of this model's parameters "
            f"on the host, not {offload.ratio}: the split is by whole parameter leaves, and "
            f"the largest holds {max(sizes) / max(sum(sizes), 1):.2f} of them. Pick a ratio "
            "near a leaf boundary (opt.plan(params).describe() lists each leaf's memory).",
            stacklevel=5,
        )
    return {-1: True, **dict(enumerate(chosen))}


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


def param_owners(
    tx: optax.GradientTransformation, params_def: Any, opt_state: Any
) -> list[int] | None:
    """Per leaf of ``opt_state``, the index of the parameter leaf it belongs to (-1: none);
    None when Optax cannot tell (an ``init`` that inspects its parameters' values)."""
    index = jax.tree.unflatten(params_def, list(range(params_def.num_leaves)))
    try:
        owners = optax.tree_map_params(
            tx, lambda _, i: i, opt_state, index, transform_non_params=lambda _: -1
        )
    except Exception:  # noqa: BLE001 -- any failure means: ownership unknown
        return None
    owners = jax.tree.leaves(owners)
    return owners if len(owners) == len(jax.tree.leaves(opt_state)) else None


class Pending(NamedTuple):
    """The gradient a delayed step holds for the next (``Offload(delay=1)``): ZeRO-Offload's
    delayed parameter update applies it one step late."""

    grads: Any  # per parameter leaf, as reduced: stored shards, reduce dtype, host memory
    denominator: jax.Array  # f32 scalar the reduced sums are divided by
    apply: jax.Array  # bool scalar: False until a delayed step has taken a gradient


@struct.dataclass
class ZeroState:
    """Parameters and optimizer state of a ZeRO-partitioned model.

    Attributes:
        step: int32 scalar, replicated; number of train steps taken (steps skipped by
            dynamic loss scaling included; Optax's own counters skip them).
        params: the parameters as stored at rest. Stages 0-2: full, true shapes, replicated
            over 'data'. Stage 3: each sharded leaf padded along its shard dimension and
            partitioned over 'data' (see ``plan``); small leaves replicated.
        opt_state: the Optax state. Stage 0: replicated. Stages 1-3: every leaf laid out
            like a parameter of its shape (sharded and padded over 'data').
        master: fp32 master weights when the precision policy stores parameters in a
            16-bit dtype, laid out like the optimizer state (sharded over 'data' in stages
            1-3, padded); None otherwise.
        loss_scale: dynamic loss-scaling state (:class:`LossScale`), or None.
        model_state: non-trainable model state (e.g. Flax ``batch_stats``), replicated over
            'data' and kept identical on every device; None when the model has none.
        plan: the static :class:`Plan`: where every leaf lives (not a pytree node).
        pending: with ``Offload(delay=1)``, the :class:`Pending` gradient that the next
            delayed step applies; None otherwise.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    master: Any
    loss_scale: Any
    plan: Plan = struct.field(pytree_node=False)
    pending: Any = None
