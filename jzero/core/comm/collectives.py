"""The collectives jzero writes, for use inside ``jax.shard_map`` over the ``data`` axis.

Every function here runs in the per-device (local) view. ``Sharded`` is the handle a
stage-2/3 loss function receives for a sharded parameter; :func:`gather` turns it into the
full parameter, with the backward pass reduce-scattering its gradient.
"""

from __future__ import annotations

from collections.abc import Callable
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
from ..host_memory import in_host_memory
from ..leaf_layout import LeafLayout
from ..mesh import DATA
from .hpz import SECONDARY

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


def after(
    tree: Any,
    dep: Any,
    *,
    only: Literal["host", "device"] | None = None,
    zero_once: bool = False,
) -> Any:
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

    ``zero_once``: compute the zero once, behind an ``optimization_barrier``, for a tie of
    many leaves to many (stage 1's gradients to each other). Unbarred, XLA's fusion copies
    the cheap sum of every ``dep`` leaf into each tied leaf's fusion: ops as their product
    (XLA:CPU, 161 gradient leaves: 168 K HLO lines, 8 x plain jit's first step). Not by
    default: stage 3's per-layer ties (few ``dep`` leaves) gain nothing, and the barrier
    moved XLA:CPU's schedule (a higher peak with a remat policy).
    """
    floats = [d for d in jax.tree.leaves(dep) if jnp.issubdtype(d.dtype, jnp.inexact) and d.size]
    if not floats:
        return tree
    s = sum(jnp.real(d.reshape(-1)[0]).astype(jnp.float32) for d in floats)
    zero = jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s)) * 0  # exactly +-0, never NaN
    if zero_once:
        zero = jax.lax.optimization_barrier(zero)

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
