"""How stage 3's parameters are gathered where they are used: the :class:`Gatherer`
strategy, the :class:`Sharded` handle the loss sees, and :func:`gather`.

A :class:`Gatherer` is built once from the run's configuration (:meth:`Gatherer.of`):
exact or quantized all-gathers (ZeRO++'s qwZ, :mod:`.quantize`), leaf by leaf or one flat
collective per layer (:mod:`.buckets`), in hpZ's two steps (:mod:`.hpz`), prefetched one
layer ahead in scans (:mod:`jzero.core.gather.prefetch`). Every gather's backward
reduce-scatters the gradient with the step's :class:`.reducer.Reducer`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from ...internal.primitives import varying_axes
from ..leaf_layout import LeafLayout
from ..mesh import DATA, whole_over_data
from ..options.communication import Quant
from ..options.zero_config import ZeroConfig
from .buckets import all_gather_flat, flat_shards, leaves_of_rows
from .collectives import GATHERED, all_gather, on_device
from .hpz import SECONDARY, gather_group, gather_secondary
from .quantize import quantized_all_gather
from .reducer import Reducer


@dataclasses.dataclass(frozen=True)
class Gatherer:
    """How a step gathers its parameters (static: hashable, part of the trace).

    Attributes:
        gathers: stage 3: all-gather each shard where it is used; stage 2: the loss uses
            the local full copy (only the backward reduce-scatter remains).
        quant: how the all-gathers are quantized (``Communication.gather_quant``), or None.
        bucket: one flat collective per layer and dtype (``Communication.bucket``).
        hpz: hpZ's group size (``Communication.hpz``), or None.
        prefetch: scans over stacked layers gather layer i+1 during layer i
            (``Communication.prefetch``).
    """

    gathers: bool = True
    quant: Quant | None = None
    bucket: bool = False
    hpz: int | None = None
    prefetch: bool = False

    @classmethod
    def of(cls, config: ZeroConfig) -> Gatherer:
        """The gatherer ``config`` asks for."""
        comm, gathers = config.comm, config.partitions_params
        hpz = comm.hpz if gathers else None
        return cls(gathers, comm.gather_quantizer, comm.bucket, hpz, comm.prefetch)

    def all_gather(self, shards: list, layouts: Sequence[LeafLayout]) -> list:
        """Local shards (in device memory) -> full parameters, each named ``GATHERED``:
        exact or quantized, one collective per leaf or (``bucket``) one flat one."""
        if self.quant is not None and self.bucket:
            full = quantized_all_gather(shards, layouts, quant=self.quant)
        elif self.quant is not None:
            full = [
                quantized_all_gather([s], [lay], quant=self.quant)[0]
                for s, lay in zip(shards, layouts)
            ]
        elif self.bucket:
            full = all_gather_flat(shards, layouts)
        else:
            return [all_gather(s, lay) for s, lay in zip(shards, layouts)]
        return [checkpoint_name(x, GATHERED) for x in full]

    def use(self, values: list, layouts: Sequence[LeafLayout]) -> list:
        """What the loss sees of the stored ``values``: gathered (stage 3, first copied in
        where they rest in host memory), or the local full copies (stage 2)."""
        if self.gathers:
            return self.all_gather([on_device(x) for x in values], layouts)
        # named as gathered, so that no remat policy of jzero's saves it for backward (a
        # scan step reading its layer would save a second copy of the whole stack)
        return [checkpoint_name(_varying(x), GATHERED) for x in values]


def _varying(x: jax.Array) -> jax.Array:
    """``x`` varying over 'data' (a layer indexed in a loop whose index varies already is)."""
    return x if DATA in varying_axes(x) else jax.lax.pcast(x, DATA, to="varying")


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _use(sinks, copies, values, layouts: tuple, gatherer: Gatherer, reducer: Reducer) -> list:
    """:meth:`Gatherer.use` of ``values``; backward reduce-scatters the cotangents with
    ``reducer`` into ``sinks``: leaf by leaf, or one flat collective with ``bucket``.
    ``copies`` (per leaf, a host-memory sink or None) receive the host copies of the
    reduced shards (:meth:`.reducer.Reducer.host_copy`)."""
    del sinks, copies
    return gatherer.use(list(values), layouts)


def _use_fwd(sinks, copies, values, layouts, gatherer, reducer):
    copied = [() if c is not None else None for c in copies]  # the pattern, no array
    return _use(sinks, copies, values, layouts, gatherer, reducer), copied


def _use_bwd(layouts, gatherer, reducer, copied, cts):
    grads = reducer.scatter(list(cts), layouts, flat=gatherer.bucket)
    return (
        grads,
        reducer.host_copy(grads, tuple(c is not None for c in copied)),
        [None] * len(grads),
    )


_use.defvjp(_use_fwd, _use_bwd)


def secondary_copy(values: Sequence[jax.Array], layouts: Any, group: int, quant: Quant | None):
    """hpZ's first gather (:mod:`.hpz`): local shards (one dtype) -> their secondary copy,
    ``[K, total]``, named so that every remat policy of jzero's saves it."""
    flat = flat_shards(values, layouts)
    sizes = [math.prod(x.shape) for x in values]
    rows = gather_secondary(flat, group=group, sizes=sizes, quant=quant)
    return checkpoint_name(rows, SECONDARY)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _use_group(sinks, secondary, shapes: tuple, layouts: tuple, gatherer, reducer, flat) -> list:
    """hpZ's second gather: the group's secondary copies -> full leaves of ``shapes``'
    layouts (exact); backward reduce-scatters the cotangents over the whole data axis, as
    :func:`_use` (one flat collective with ``flat``)."""
    del sinks
    rows = gather_group(secondary, group=gatherer.hpz)
    return [checkpoint_name(x, GATHERED) for x in leaves_of_rows(rows, shapes, layouts)]


def _use_group_fwd(sinks, secondary, shapes, layouts, gatherer, reducer, flat):
    return _use_group(sinks, secondary, shapes, layouts, gatherer, reducer, flat), None


def _use_group_bwd(shapes, layouts, gatherer, reducer, flat, _, cts):
    return reducer.scatter(list(cts), layouts, flat=flat), None


_use_group.defvjp(_use_group_fwd, _use_group_bwd)


def _hpz_gather(handles: Sequence[Sharded], *, flat: bool) -> list:
    """hpZ handles (one value dtype) gathered in two steps (:mod:`.hpz`), their secondary
    copy made here, or, where they carry theirs, those side by side: the columns of
    their flat vectors, as :func:`secondary_copy` of them all would make it."""
    values, layouts = [h.value for h in handles], tuple(h.layout for h in handles)
    first = handles[0]
    if all(h.secondary is None for h in handles):
        secondary = secondary_copy(values, layouts, first.gatherer.hpz, first.gatherer.quant)
    else:
        secondary = jnp.concatenate([h.with_secondary().secondary for h in handles], axis=1)
    shapes = tuple(tuple(x.shape) for x in values)
    sinks = [h.sink for h in handles]
    no_copies(handles, "hpZ's group gather")
    return _use_group(sinks, secondary, shapes, layouts, first.gatherer, first.reducer, flat)


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A sharded parameter as the loss function sees it in stages 2 and 3.

    Attributes:
        sink: zeros of this device's shard shape, in the gradient-reduction dtype; the
            step differentiates with respect to it, so its gradient is the
            reduce-scattered (summed) gradient shard.
        value: with ``gatherer.gathers`` (stage 3), this device's shard of the stored
            parameter; otherwise (stage 2) the replicated full parameter.
        layout: the leaf's :class:`LeafLayout` (static).
        gatherer: how :meth:`gather` gathers it (:class:`Gatherer`; static).
        reducer: how backward reduce-scatters its gradient (:class:`.reducer.Reducer`;
            static).
        secondary: with hpZ, this leaf's secondary copy if already gathered (e.g. kept
            for backward by :func:`jzero.remat_layer`), else None.
        host_copy: where backward makes the host copy of the reduced shard
            (``reducer.host_copies``): zeros of the sink's shape in host memory, whose
            gradient is that copy; else None.
    """

    def __init__(
        self,
        sink,
        value,
        layout: LeafLayout,
        gatherer: Gatherer,
        reducer: Reducer,
        secondary=None,
        host_copy=None,
    ):
        self.sink, self.value, self.layout = sink, value, layout
        self.gatherer, self.reducer, self.secondary = gatherer, reducer, secondary
        self.host_copy = host_copy

    @property
    def gathers(self) -> bool:
        """Whether :meth:`gather` all-gathers (stage 3) or uses the local full copy."""
        return self.gatherer.gathers

    @property
    def hpz(self) -> int | None:
        """hpZ's group size where this leaf is gathered in two steps, else None."""
        return self.gatherer.hpz if self.gathers else None

    def tree_flatten(self):
        children = (self.sink, self.value, self.secondary, self.host_copy)
        return children, (self.layout, self.gatherer, self.reducer)

    @classmethod
    def tree_unflatten(cls, aux, children):
        sink, value, secondary, host_copy = children
        return cls(sink, value, *aux, secondary=secondary, host_copy=host_copy)

    def gather(self) -> jax.Array:
        """This leaf alone: one all-gather (stage 3; hpZ: two), one reduce-scatter in
        backward."""
        if self.hpz is not None:
            return _hpz_gather([self], flat=False)[0]
        how = (self.layout,), self.gatherer, self.reducer
        return _use([self.sink], [self.host_copy], [self.value], *how)[0]

    def with_secondary(self, secondary: jax.Array | None = None) -> Sharded:
        """This handle carrying its secondary copy: ``secondary`` (its columns of a
        bucket's, :func:`with_secondaries`), or hpZ's first gather done now; itself
        without hpZ."""
        if self.hpz is None or self.secondary is not None:
            return self
        if secondary is None:
            quant = self.gatherer.quant
            secondary = secondary_copy([self.value], (self.layout,), self.hpz, quant)
        how = self.layout, self.gatherer, self.reducer
        return Sharded(self.sink, self.value, *how, secondary=secondary, host_copy=self.host_copy)

    def __repr__(self) -> str:
        quant = self.gatherer.quant
        quant = f", quant={quant}" if quant is not None and self.gathers else ""
        return (
            f"Sharded(shape={self.layout.shape}, dim={self.layout.dim}, "
            f"gathers={self.gathers}{quant})"
        )


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def with_secondaries(tree: Any) -> Any:
    """``tree`` with each hpZ handle carrying its secondary copy (:meth:`Sharded.with_secondary`):
    what a rematerialised layer keeps for backward, which then gathers within groups only.
    Bucketed handles make theirs in one flat gather per bucket, each keeping its columns."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
    pending = lambda x: _is_sharded(x) and x.hpz is not None and x.secondary is None
    out = [x.with_secondary() if pending(x) and not x.gatherer.bucket else x for x in leaves]
    for idx in _buckets(leaves, lambda x: pending(x) and x.gatherer.bucket).values():
        hs = [leaves[i] for i in idx]
        layouts, quant = tuple(h.layout for h in hs), hs[0].gatherer.quant
        rows = secondary_copy([h.value for h in hs], layouts, hs[0].hpz, quant)
        ends = list(itertools.accumulate(math.prod(h.value.shape) for h in hs))
        for i, h, start, end in zip(idx, hs, [0, *ends], ends):
            out[i] = h.with_secondary(rows[:, start:end])
    return jax.tree.unflatten(treedef, out)


def without_secondaries(tree: Any) -> Any:
    """``tree`` (e.g. :func:`with_secondaries`'s cotangents) with the secondary copies
    dropped: the structure of the handles as the step made them."""
    one = lambda x: Sharded(x.sink, x.value, x.layout, x.gatherer, x.reducer, host_copy=x.host_copy)
    return jax.tree.map(lambda x: one(x) if _is_sharded(x) else x, tree, is_leaf=_is_sharded)


def _buckets(leaves: list, member: Any) -> dict[tuple, list[int]]:
    """The indices of the ``member`` handles among ``leaves``, by bucket: one gatherer,
    reducer, value dtype and gradient dtype each."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if member(x):
            dtypes = (jnp.dtype(x.value.dtype), jnp.dtype(x.sink.dtype))
            groups.setdefault((x.gatherer, x.reducer, *dtypes), []).append(i)
    return groups


def _gather_leaves(leaves: list) -> list:
    """Each handle gathered: alone, or with the other bucketed handles of its kind."""
    bucketed = lambda x: _is_sharded(x) and x.gatherer.bucket
    out = [x.gather() if _is_sharded(x) and not bucketed(x) else x for x in leaves]
    for (gatherer, reducer, *_), idx in _buckets(leaves, bucketed).items():
        hs = [leaves[i] for i in idx]
        if hs[0].hpz is not None:  # one flat secondary copy (or theirs), one group gather
            full = _hpz_gather(hs, flat=True)
        else:
            full = _use(
                [h.sink for h in hs],
                [h.host_copy for h in hs],
                [h.value for h in hs],
                tuple(h.layout for h in hs),
                gatherer,
                reducer,
            )
        for i, x in zip(idx, full):
            out[i] = x
    return out


def gather_each(tree: Any) -> Any:
    """:func:`gather`, but every leaf in a collective of its own (never bucketed)."""
    one = lambda x: x.gather() if _is_sharded(x) else x
    return jax.tree.map(one, tree, is_leaf=_is_sharded)


def gather(tree: Any, *, mesh: Mesh | None = None) -> Any:
    """Full parameters from a tree that may hold :class:`Sharded` handles.

    Inside a loss function given to ``ZeroOptimizer.train_step(..., manual_gather=True)``,
    call this on each layer's parameters where the layer uses them (e.g. inside the body
    of a ``lax.scan`` over stacked layers): stage 3 then all-gathers one layer at a time and
    backward gathers it again. Outside stages 2/3, and on plain arrays, it returns its
    input unchanged, so the same loss function serves every stage.

    In your own ``jit`` step at stage 3 (:func:`jzero.shard_optimizer`), pass the ``mesh``:
    plain arrays are then constrained whole where the layer uses them, so the compiler
    gathers the layer's parameters instead of resharding its activations
    (:func:`jzero.core.mesh.whole_over_data`). The mesh may have no other axes than ``data`` and
    ``replica``; inside jzero's own step ``mesh`` changes nothing.

    Examples:
        >>> def loss_fn(params, batch):
        ...     def layer(x, p):
        ...         p = jzero.gather(p)
        ...         return jnp.tanh(x @ p['w']), None
        ...     x, _ = jax.lax.scan(layer, batch['x'], params['layers'])
        ...     return jnp.mean((x - batch['y']) ** 2)
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
    tree = jax.tree.unflatten(treedef, _gather_leaves(leaves))
    return tree if mesh is None else whole_over_data(tree, mesh)


def no_copies(handles: Sequence[Sharded], where: str) -> None:
    """Refuses handles whose gradient backward should copy to host memory on a path whose
    backward rule returns the reduced shard only (its copy would silently be zero)."""
    if any(h.host_copy is not None for h in handles):
        raise NotImplementedError(
            f"{where} does not copy gradients to host memory in backward; "
            "jzero.core.comm.reducer.makes_host_copies should have left this step's copies off."
        )
