"""The collectives jzero writes, for use inside ``jax.shard_map`` over the ``data`` axis.

Every function here runs in the per-device (local) view. ``Sharded`` is the handle a
stage-2/3 loss function receives for a sharded parameter; :func:`gather` turns it into the
full parameter, with the backward pass reduce-scattering its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ...internal.primitives import (
    checkpoint_name_of,
    custom_vjp_body,
    is_copy_to_device,
    is_trimming_pad,
    varying_axes,
)
from ..leaf_layout import LeafLayout, pad
from ..mesh import DATA
from .buckets import all_gather_flat, flat_shards, leaves_of_rows, reduce_scatter_flat
from .hpz import SECONDARY, gather_group, gather_secondary
from .quantize import Quant, quantized_all_gather, quantized_reduce_scatter

GATHERED = "jzero_gathered"
"""``checkpoint_name`` of every gathered parameter, so remat policies can refuse to save
it: backward then gathers again instead of keeping forward's copy alive."""


def regather_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy for stage 3: save anything except gathered parameters.

    Refuses the results of ``all_gather``, of the negative ``lax.pad`` that trims its
    padding (user code has no use for negative pads) and of copies into device memory
    (an offloaded shard brought in to be gathered), so backward copies and gathers each
    parameter again rather than keeping forward's copy.
    """
    if prim is jax.lax.all_gather_p or is_trimming_pad(prim, params):
        return False
    if is_copy_to_device(prim, params):
        return False
    return checkpoint_name_of(prim, params) != GATHERED


def _gathers_inside(prim: Any, params: dict[str, Any]) -> bool:
    """Whether ``prim`` is a ``custom_vjp`` (``jzero.gather``'s ``_use``) that all-gathers."""
    return any(
        p is jax.lax.all_gather_p or checkpoint_name_of(p, ps) == GATHERED
        for p, ps in custom_vjp_body(prim, params)
    )


def saves_no_gathered(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``policy``, but never saving (or offloading) a gathered parameter.

    On top of ``regather_policy``: under ``jax.vjp`` (direct linearize) the policy sees
    ``jzero.gather``'s custom VJP as one ``custom_vjp_call``, not its ``all_gather``, and
    a ``reduce_precision`` (a no-op at the value's own precision) JAX adds after it; both
    would save the gathered parameter. ``reduce_precision`` is never saved (backward
    redoes it from whatever its input is). Everything else gets ``policy``'s own answer,
    passed through unchanged: a bool, or an offloading policy's ``Offloadable`` (e.g.
    ``jax.checkpoint_policies.save_and_offload_only_these_names``: the value is kept in
    host memory until backward). An hpZ secondary copy (:mod:`.hpz`) is always saved:
    keeping it is what hpZ trades memory for.
    """

    def combined(prim: Any, *args: Any, **params: Any) -> Any:
        if checkpoint_name_of(prim, params) == SECONDARY:
            return True
        if _gathers_inside(prim, params):
            return False
        if prim is jax.lax.reduce_precision_p:
            return False
        if not regather_policy(prim, *args, **params):
            return False
        return policy(prim, *args, **params)

    return combined


def in_host_memory(x: Any) -> bool:
    """Whether the (traced) array ``x`` is in host memory, e.g. an offloaded shard."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def on_device(x: jax.Array) -> jax.Array:
    """``x`` in the device's own memory: a host -> device copy where ``x`` rests in host
    memory (stage 3's parameter shards with ``Offload(params=True)``), else ``x`` itself.

    Every gather starts with it, inside the ``custom_vjp`` (or remat region) that gathers,
    so backward copies the shard in again where it gathers again: the device never keeps
    a copy of an offloaded shard between forward and backward.
    """
    if in_host_memory(x):
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def after(tree: Any, dep: Any, *, only: Literal["host", "device"] | None = None) -> Any:
    """``tree`` unchanged bit for bit, but data-dependent on every float leaf of ``dep``.

    An ordering constraint that survives XLA:CPU, whose pipeline drops optimization
    barriers before scheduling: each float leaf of ``tree`` gets an exact zero derived
    from ``dep`` added (``x * 0`` of a finite value is never folded). Leaves whose
    varying mesh axes don't include ``dep``'s are left alone. A leaf in host memory (an
    offloaded shard) is tied by an ``optimization_barrier`` instead (no arithmetic on host
    memory; XLA:CPU, which drops the barrier, has one memory and no copy to order). It
    has no transpose for a host leaf's (device-typed) zero cotangent: ``only="device"``
    or ``"host"`` ties those leaves alone, so that a differentiated tie can leave host
    leaves to an undifferentiated one.
    """
    floats = [d for d in jax.tree.leaves(dep) if jnp.issubdtype(d.dtype, jnp.inexact) and d.size]
    if not floats:
        return tree
    s = sum(d.reshape(-1)[0].astype(jnp.float32) for d in floats)
    zero = jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s)) * 0  # exactly +-0, never NaN

    def tie(a):
        if not jnp.issubdtype(a.dtype, jnp.inexact) or not varying_axes(zero) <= varying_axes(a):
            return a
        host = in_host_memory(a)
        if only is not None and only != ("host" if host else "device"):
            return a
        if host:
            return jax.lax.optimization_barrier((a, zero))[0]
        return a + zero.astype(a.dtype)

    return jax.tree.map(tie, tree)


def all_gather(shard: jax.Array, layout: LeafLayout) -> jax.Array:
    """Local shard -> full parameter of the true shape (padding dropped)."""
    axis = layout.axis(shard)
    full = jax.lax.all_gather(shard, DATA, axis=axis, tiled=True)
    if layout.pad:  # a negative lax.pad, not a slice, so that regather_policy can spot it
        config = [(0, 0, 0)] * full.ndim
        config[axis] = (0, -layout.pad, 0)
        full = jax.lax.pad(full, jnp.zeros((), full.dtype), config)
    return checkpoint_name(full, GATHERED)


def reduce_scatter(grad: jax.Array, layout: LeafLayout, quant: Quant | None = None) -> jax.Array:
    """Local full gradient -> this device's shard of the sum over devices (``quant``: sent
    quantized, :func:`.quantize.quantized_reduce_scatter`)."""
    if quant is not None:
        return quantized_reduce_scatter([grad], [layout], quant=quant)[0]
    return jax.lax.psum_scatter(
        pad(grad, layout), DATA, scatter_dimension=layout.axis(grad), tiled=True
    )


def scatter_flat(grads: list, layouts: Any, quant: Quant | None) -> list:
    """:func:`.buckets.reduce_scatter_flat`, or its quantized form with ``quant``."""
    if quant is not None:
        return quantized_reduce_scatter(grads, layouts, quant=quant)
    return reduce_scatter_flat(grads, layouts)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _use(
    sink,
    value,
    layout: LeafLayout,
    gathers: bool,
    reduce_dtype: Any,
    quant: Quant | None,
    grad_quant: Quant | None,
) -> jax.Array:
    """``gathers`` (stage 3): all-gather the shard ``value``, first copied to the device
    where it rests in host memory (:func:`on_device`; ``quant``: quantized,
    :mod:`.quantize`); otherwise (stage 2) use the local full copy ``value``. Either way
    the backward pass reduce-scatters the cotangent, in ``reduce_dtype`` (``grad_quant``:
    quantized), into ``sink``."""
    del sink, grad_quant
    value = on_device(value) if gathers else value
    if gathers and quant is not None:
        return checkpoint_name(quantized_all_gather([value], [layout], quant=quant)[0], GATHERED)
    if gathers:
        return all_gather(value, layout)
    return jax.lax.pcast(value, DATA, to="varying")


def _use_fwd(sink, value, layout, gathers, reduce_dtype, quant, grad_quant):
    return _use(sink, value, layout, gathers, reduce_dtype, quant, grad_quant), None


def _use_bwd(layout, gathers, reduce_dtype, quant, grad_quant, _, ct):
    return reduce_scatter(ct.astype(reduce_dtype), layout, grad_quant), None


_use.defvjp(_use_fwd, _use_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _use_bucket(
    sinks,
    values,
    layouts,
    gathers: bool,
    reduce_dtype: Any,
    quant: Quant | None,
    grad_quant: Quant | None,
) -> list:
    """:func:`_use` for several leaves of one dtype, as one flat all-gather (``gathers``;
    ``quant``: quantized) and, in backward, one flat reduce-scatter (:mod:`.buckets`;
    ``grad_quant``: quantized)."""
    del sinks, grad_quant
    values = [on_device(x) for x in values] if gathers else values
    if gathers and quant is not None:
        full = quantized_all_gather(values, layouts, quant=quant)
        return [checkpoint_name(x, GATHERED) for x in full]
    if gathers:
        return [checkpoint_name(x, GATHERED) for x in all_gather_flat(values, layouts)]
    return [jax.lax.pcast(x, DATA, to="varying") for x in values]


def _use_bucket_fwd(sinks, values, layouts, gathers, reduce_dtype, quant, grad_quant):
    return _use_bucket(sinks, values, layouts, gathers, reduce_dtype, quant, grad_quant), None


def _use_bucket_bwd(layouts, gathers, reduce_dtype, quant, grad_quant, _, cts):
    grads = scatter_flat([ct.astype(reduce_dtype) for ct in cts], layouts, grad_quant)
    return grads, [None] * len(grads)


_use_bucket.defvjp(_use_bucket_fwd, _use_bucket_bwd)


def secondary_copy(values: Sequence[jax.Array], layouts: Any, group: int, quant: Quant | None):
    """hpZ's first gather (:mod:`.hpz`): local shards (one dtype) -> their secondary copy,
    ``[K, total]``, named so that every remat policy of jzero's saves it."""
    flat = flat_shards(values, layouts)
    sizes = [math.prod(x.shape) for x in values]
    rows = gather_secondary(flat, group=group, sizes=sizes, quant=quant)
    return checkpoint_name(rows, SECONDARY)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _use_group(sinks, secondary, shapes: tuple, layouts: tuple, group: int, how: tuple) -> list:
    """hpZ's second gather: the group's secondary copies -> full leaves of ``shapes``'
    layouts (exact); backward reduce-scatters the cotangents over the whole data axis, as
    :func:`_use` (``how``: reduce dtype, gradient quantizer, bucketed)."""
    del sinks, how
    rows = gather_group(secondary, group=group)
    return [checkpoint_name(x, GATHERED) for x in leaves_of_rows(rows, shapes, layouts)]


def _use_group_fwd(sinks, secondary, shapes, layouts, group, how):
    return _use_group(sinks, secondary, shapes, layouts, group, how), None


def _use_group_bwd(shapes, layouts, group, how, _, cts):
    reduce_dtype, grad_quant, bucket = how
    cts = [ct.astype(reduce_dtype) for ct in cts]
    if bucket:
        return scatter_flat(cts, layouts, grad_quant), None
    return [reduce_scatter(ct, lay, grad_quant) for ct, lay in zip(cts, layouts)], None


_use_group.defvjp(_use_group_fwd, _use_group_bwd)


def _hpz_gather(handles: Sequence[Sharded], *, bucket: bool) -> list:
    """hpZ handles (one value dtype and reduce dtype) gathered in two steps (:mod:`.hpz`),
    their secondary copy made here unless the handle carries it (one handle)."""
    values, layouts = [h.value for h in handles], tuple(h.layout for h in handles)
    first = handles[0]
    secondary = first.secondary
    if secondary is None:
        secondary = secondary_copy(values, layouts, first.hpz, first.quant)
    how = (first.sink.dtype, first.grad_quant, bucket)
    shapes = tuple(tuple(x.shape) for x in values)
    return _use_group([h.sink for h in handles], secondary, shapes, layouts, first.hpz, how)


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A sharded parameter as the loss function sees it in stages 2 and 3.

    Attributes:
        sink: zeros of this device's shard shape, in the gradient-reduction dtype; the
            step differentiates with respect to it, so its gradient is the
            reduce-scattered (summed) gradient shard.
        value: with ``gathers`` (stage 3), this device's shard of the stored parameter;
            otherwise (stage 2) the replicated full parameter.
        layout: the leaf's :class:`LeafLayout` (static).
        gathers: whether :meth:`gather` all-gathers (the parameters are partitioned, stage
            3) or uses the local full copy (stage 2); static, from the plan.
        bucket: whether :func:`gather` sends this leaf with the others of its call (a
            layer) in one flat collective per dtype; static, the step's ``bucket``.
        quant: with ``gathers``, how the all-gather is quantized (:class:`.quantize.Quant`,
            from ``Communication.gather_quant``), or None; static.
        grad_quant: how the backward reduce-scatter is quantized (from
            ``Communication.grad_quant``), or None; static.
        hpz: with ``gathers``, hpZ's group size G (:mod:`.hpz`: gathered across the groups
            into a secondary copy, then within the group), or None; static.
        secondary: with ``hpz``, this leaf's secondary copy if already gathered (e.g. kept
            for backward by :func:`jzero.remat_layer`), else None.
    """

    def __init__(
        self,
        sink,
        value,
        layout: LeafLayout,
        *,
        gathers: bool,
        bucket: bool = False,
        quant: Quant | None = None,
        grad_quant: Quant | None = None,
        hpz: int | None = None,
        secondary=None,
    ):
        self.sink, self.value, self.layout = sink, value, layout
        self.gathers, self.bucket = gathers, bucket
        self.quant, self.grad_quant = quant, grad_quant
        self.hpz, self.secondary = (hpz if gathers else None), secondary

    def tree_flatten(self):
        aux = (self.layout, self.gathers, self.bucket, self.quant, self.grad_quant, self.hpz)
        return (self.sink, self.value, self.secondary), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, gathers, bucket, quant, grad_quant, hpz = aux
        sink, value, secondary = children
        return cls(
            sink, value, layout, gathers=gathers, bucket=bucket, quant=quant,
            grad_quant=grad_quant, hpz=hpz, secondary=secondary,
        )  # fmt: skip

    def gather(self) -> jax.Array:
        """This leaf alone: one all-gather (stage 3; hpZ: two), one reduce-scatter in
        backward."""
        if self.hpz is not None:
            return _hpz_gather([self], bucket=False)[0]
        return _use(
            self.sink, self.value, self.layout, self.gathers, self.sink.dtype, self.quant,
            self.grad_quant,
        )  # fmt: skip

    def with_secondary(self) -> Sharded:
        """This handle carrying its secondary copy (hpZ's first gather done now); itself
        without hpZ."""
        if self.hpz is None or self.secondary is not None:
            return self
        secondary = secondary_copy([self.value], (self.layout,), self.hpz, self.quant)
        _, aux = self.tree_flatten()
        return Sharded.tree_unflatten(aux, (self.sink, self.value, secondary))

    def __repr__(self) -> str:
        quant = f", quant={self.quant}" if self.quant is not None else ""
        return (
            f"Sharded(shape={self.layout.shape}, dim={self.layout.dim}, "
            f"gathers={self.gathers}{quant})"
        )


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def with_secondaries(tree: Any) -> Any:
    """``tree`` with each hpZ handle carrying its secondary copy (:meth:`Sharded.with_secondary`):
    what a rematerialised layer keeps for backward, which then gathers within groups only."""
    one = lambda x: x.with_secondary() if _is_sharded(x) else x
    return jax.tree.map(one, tree, is_leaf=_is_sharded)


def without_secondaries(tree: Any) -> Any:
    """``tree`` (e.g. :func:`with_secondaries`'s cotangents) with the secondary copies
    dropped: the structure of the handles as the step made them."""
    one = lambda x: Sharded.tree_unflatten(x.tree_flatten()[1], (x.sink, x.value, None))
    return jax.tree.map(lambda x: one(x) if _is_sharded(x) else x, tree, is_leaf=_is_sharded)


def _hpz_bucket(handles: list[Sharded]) -> list:
    """A bucket of hpZ handles: one flat secondary copy and one flat group gather, or, where
    they carry secondary copies of their own (:meth:`Sharded.with_secondary`), one by one."""
    if any(h.secondary is not None for h in handles):
        return [h.gather() for h in handles]
    return _hpz_gather(handles, bucket=True)


def _gather_leaves(leaves: list) -> list:
    """Each handle gathered: alone, or with the other bucketed handles of its kind."""
    out = [x.gather() if _is_sharded(x) and not x.bucket else x for x in leaves]
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_sharded(x) and x.bucket:
            dtypes = (jnp.dtype(x.value.dtype), jnp.dtype(x.sink.dtype))
            groups.setdefault((x.gathers, *dtypes, x.quant, x.grad_quant, x.hpz), []).append(i)
    for (gathers, _, reduce_dtype, quant, grad_quant, hpz), idx in groups.items():
        hs = [leaves[i] for i in idx]
        if hpz is not None:
            for i, x in zip(idx, _hpz_bucket(hs)):
                out[i] = x
            continue
        full = _use_bucket(
            [h.sink for h in hs], [h.value for h in hs], tuple(h.layout for h in hs),
            gathers, reduce_dtype, quant, grad_quant,
        )  # fmt: skip
        for i, x in zip(idx, full):
            out[i] = x
    return out


def gather_each(tree: Any) -> Any:
    """:func:`gather`, but every leaf in a collective of its own (never bucketed)."""
    one = lambda x: x.gather() if _is_sharded(x) else x
    return jax.tree.map(one, tree, is_leaf=_is_sharded)


def gather(tree: Any) -> Any:
    """Full parameters from a tree that may hold :class:`Sharded` handles.

    Inside a loss function given to ``ZeroOptimizer.train_step(..., manual_gather=True)``,
    call this on each layer's parameters where the layer uses them (e.g. inside the body
    of a ``lax.scan`` over stacked layers): stage 3 then all-gathers one layer at a time and
    backward gathers it again. Outside stages 2/3, and on plain arrays, it returns its
    input unchanged, so the same loss function serves every stage.

    Examples:
        >>> def loss_fn(params, batch):
        ...     def layer(x, p):
        ...         p = jzero.gather(p)
        ...         return jnp.tanh(x @ p['w']), None
        ...     x, _ = jax.lax.scan(layer, batch['x'], params['layers'])
        ...     return jnp.mean((x - batch['y']) ** 2)
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
    return jax.tree.unflatten(treedef, _gather_leaves(leaves))
