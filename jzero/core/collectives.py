"""The collectives jzero writes, for use inside ``jax.shard_map`` over the ``data`` axis.

Every function here runs in the per-device (local) view. ``Sharded`` is the handle a
stage-2/3 loss function receives for a sharded parameter; :func:`gather` turns it into the
full parameter, with the backward pass reduce-scattering its gradient.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .layout import LeafLayout, pad
from .mesh import DATA

GATHERED = "jzero_gathered"
"""``checkpoint_name`` of every gathered parameter, so remat policies can refuse to save
it: backward then gathers again instead of keeping forward's copy alive."""


def regather_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy for stage 3: save anything except gathered parameters.

    Refuses the results of ``all_gather`` and of the negative ``lax.pad`` that trims its
    padding (user code has no use for negative pads),
    so backward gathers each parameter again rather than keeping forward's copy.
    """
    if prim is jax.lax.all_gather_p:
        return False
    if prim is jax.lax.pad_p:
        return not any(hi < 0 for _, hi, _ in params["padding_config"])
    if prim.name == "name":  # checkpoint_name's primitive
        return params.get("name") != GATHERED
    return True


def _varying_axes(x: jax.Array) -> frozenset:
    return frozenset(getattr(jax.typeof(x), "vma", ()) or ())


def after(tree: Any, dep: Any) -> Any:
    """``tree`` unchanged bit for bit, but data-dependent on every float leaf of ``dep``.

    An ordering constraint that survives XLA:CPU, whose pipeline drops optimization
    barriers before scheduling: each float leaf of ``tree`` gets an exact zero derived
    from ``dep`` added (``x * 0`` of a finite value is never folded). Leaves whose
    varying mesh axes don't include ``dep``'s are left alone.
    """
    floats = [d for d in jax.tree.leaves(dep) if jnp.issubdtype(d.dtype, jnp.inexact) and d.size]
    if not floats:
        return tree
    s = sum(d.reshape(-1)[0].astype(jnp.float32) for d in floats)
    zero = jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s)) * 0  # exactly +-0, never NaN

    def tie(a):
        if not jnp.issubdtype(a.dtype, jnp.inexact) or not _varying_axes(zero) <= _varying_axes(a):
            return a
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


def reduce_scatter(grad: jax.Array, layout: LeafLayout) -> jax.Array:
    """Local full gradient -> this device's shard of the sum over devices."""
    return jax.lax.psum_scatter(
        pad(grad, layout), DATA, scatter_dimension=layout.axis(grad), tiled=True
    )


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _use(sink, value, layout: LeafLayout, gathers: bool, reduce_dtype: Any) -> jax.Array:
    """``gathers`` (stage 3): all-gather the shard ``value``; otherwise (stage 2) use the
    local full copy ``value``. Either way the backward pass reduce-scatters the cotangent,
    in ``reduce_dtype``, into ``sink``."""
    del sink
    if gathers:
        return all_gather(value, layout)
    return jax.lax.pcast(value, DATA, to="varying")


def _use_fwd(sink, value, layout, gathers, reduce_dtype):
    return _use(sink, value, layout, gathers, reduce_dtype), None


def _use_bwd(layout, gathers, reduce_dtype, _, ct):
    return reduce_scatter(ct.astype(reduce_dtype), layout), None


_use.defvjp(_use_fwd, _use_bwd)


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
    """

    def __init__(self, sink, value, layout: LeafLayout, *, gathers: bool):
        self.sink, self.value, self.layout, self.gathers = sink, value, layout, gathers

    def tree_flatten(self):
        return (self.sink, self.value), (self.layout, self.gathers)

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, gathers = aux
        return cls(*children, layout, gathers=gathers)

    def gather(self) -> jax.Array:
        return _use(self.sink, self.value, self.layout, self.gathers, self.sink.dtype)

    def __repr__(self) -> str:
        return f"Sharded(shape={self.layout.shape}, dim={self.layout.dim}, gathers={self.gathers})"


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
    return jax.tree.map(
        lambda x: x.gather() if isinstance(x, Sharded) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Sharded),
    )
