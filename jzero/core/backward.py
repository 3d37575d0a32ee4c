"""Forward/backward in the local view: the body of the step's ``shard_map``.

Per stage, over 'data' (within one data group of G devices):

- 0: grads of the local loss, ``psum`` (all-reduce) over 'data'.
- 1: grads of the local loss, held whole until backward ends, then ``psum_scatter``
  (reduce-scatter) leaf by leaf.
- 2: each sharded leaf enters the loss through :class:`Sharded`, whose backward
  reduce-scatters that leaf's gradient as soon as backward produces it.
- 3: each sharded leaf is ``all_gather``-ed where used (:func:`gather`); backward gathers
  it again (remat) and its transpose reduce-scatters the gradient.

Leaves below the size threshold are replicated and their gradients ``psum``-ed.

Hybrid sharding (a ``replica`` axis, HSDP): the batch is split over ``(replica, data)``,
parameters are gathered within 'data' only, and once a gradient is reduced within its
data group it is all-reduced across 'replica' -- only this device's reduce-scattered
shard from stage 1 on (the whole gradient at stage 0, and for replicated leaves).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..internal.unbound_axes import vmapped_collectives
from ..internal.vmap_axes import without_vma_checks
from . import rng
from .axis_alias import aliased
from .axis_names import as_tuple, explain_unknown_axis
from .checks import check_loss, split_model_state
from .comm.collectives import Sharded, after, gather_each, reduce_scatter, saves_no_gathered
from .comm.quantize import Quant
from .gather.autogather import gather_where_used
from .layout import LeafLayout
from .mesh import DATA, REPLICA
from .plan import Plan
from .precision import Precision
from .weighted import Weighted


def _local_shape(lay: LeafLayout) -> tuple[int, ...]:
    shape = list(lay.padded)
    shape[lay.dim] //= jax.lax.axis_size(DATA)
    return tuple(shape)


_KEEP = jax.checkpoint_policies.everything_saveable


def local_grads(
    plan: Plan,
    loss_fn: Callable,
    *,
    manual_gather: bool,
    grad_accum: int,
    precision: Precision,
    has_aux: bool,
    with_model_state: bool,
    per_device_rng: bool = True,
    aliases: tuple[str, ...] = (),
    bucket: bool = False,
    prefetch: bool = False,
):
    """The shard_map body: (params at rest, model state, loss scale, local batch) ->
    (loss, reduced gradients summed over devices and micro-batches, agreed model state, aux).

    The loss comes back as the mean over devices, or as a :class:`Weighted` of global sums
    when ``loss_fn`` returns one. ``per_device_rng``: PRNG keys in the model state are
    folded with the device's index before the loss sees them (:mod:`.rng`). ``aliases``:
    the model's names for the batch axes (:mod:`.axis_alias`; the shard_map's mesh must
    have them, as ``alias_mesh`` makes it).
    """
    lays, reduce_dtype = plan.layouts, precision.reduce_dtype
    if precision.gather_quant is not None and not plan.partitions_params:
        raise ValueError(
            f"Precision(gather_quant={precision.gather_quant!r}) quantizes stage 3's "
            f"parameter all-gathers, but stage {plan.stage} gathers no parameters; use "
            "stage=3, or leave gather_quant=None."
        )
    if precision.grad_quant is not None and plan.stage == 0:
        raise ValueError(
            f"Precision(grad_quant={precision.grad_quant!r}) quantizes the gradient "
            "reduce-scatters of stages 1-3, but stage 0 all-reduces its gradients; use "
            "stage=1, 2 or 3, or leave grad_quant=None."
        )
    axes = plan.batch_axes  # 'data', or ('replica', 'data') when hybrid

    def varying(x: jax.Array) -> jax.Array:
        # Differentiating a replicated input inside shard_map would psum its gradient
        # implicitly; differentiate a varying copy instead and reduce explicitly.
        return jax.lax.pcast(x, axes, to="varying")

    user_fn = (
        loss_fn
        if not aliases
        else aliased(loss_fn, aliases=aliases, axes=as_tuple(axes), size=plan.dp_size)
    )

    axis_sizes = {**plan.mesh.shape, **dict.fromkeys(aliases, plan.dp_size)}

    def user_loss(*args):
        try:
            return user_fn(*args)
        except Exception as e:
            if vmapped_collectives(loss_fn, args, axis_sizes):  # over its own vmap's axis
                return without_vma_checks(user_fn)(*args)
            explain_unknown_axis(e, loss_fn, args, axis_sizes)  # over an axis the step lacks
            raise

    def call_loss(params, model_state, batch):
        if with_model_state:
            seen = rng.for_device(model_state, axes) if per_device_rng else model_state
            out, new_state = split_model_state(user_loss(params, seen, batch))
            model_state = rng.settle(new_state, seen=seen, given=model_state, axes=axes)
        else:
            out = user_loss(params, batch)
        loss, aux = check_loss(out, has_aux=has_aux)
        return loss, model_state, aux

    def body(params, model_state, scale, batch):
        leaves = jax.tree.leaves(params)
        if plan.partitions_grads:  # differentiate zero "sinks" that receive the
            # reduce-scattered gradients; the parameters enter through Sharded handles
            sink = lambda lay: varying(jnp.zeros(_local_shape(lay), reduce_dtype))
            diff = [sink(lay) if lay.sharded else varying(x) for x, lay in zip(leaves, lays)]
            gathers, quant = plan.partitions_params, precision.gather_quantizer
            grad_quant = precision.grad_quantizer
            if plan.hybrid:  # varying over 'replica' like the batch, so that the
                # cotangent reaching the handle is this device's alone (no implicit psum)
                leaves = [jax.lax.pcast(x, REPLICA, to="varying") for x in leaves]
            wrap = lambda d: [
                Sharded(
                    s, x, lay, gathers=gathers, bucket=bucket, quant=quant, grad_quant=grad_quant
                )
                if lay.sharded
                else s
                for s, x, lay in zip(d, leaves, lays)
            ]
        else:
            diff = [varying(x) for x in leaves]
            wrap = lambda d: d

        def local_loss(d, model_state, micro_batch):
            p = jax.tree.unflatten(plan.params_def, wrap(d))
            if manual_gather:
                run = call_loss
            elif plan.partitions_params:  # gather each parameter where it is used
                run = gather_where_used(call_loss, prefetch=prefetch)
            else:  # leaf by leaf: stage 2 reduce-scatters each where backward completes it
                run = lambda p, *rest: call_loss(gather_each(p), *rest)
            loss, model_state, aux = run(p, model_state, micro_batch)
            if isinstance(loss, Weighted):  # differentiate the sum; divided globally later
                return loss.total * scale, (loss, model_state, aux)
            loss = loss.astype(jnp.float32)
            return loss * scale, (loss, model_state, aux)

        if plan.partitions_params and not manual_gather:
            # Keep every activation but no gathered parameter, so backward gathers again
            # (per layer inside scans). With manual_gather the user's per-layer remat
            # (jax.checkpoint / nn.remat around the layer that calls jzero.gather)
            # re-gathers instead; an outer policy here would override it.
            local_loss = jax.checkpoint(local_loss, policy=saves_no_gathered(_KEEP))
        grad_fn = jax.grad(local_loss, has_aux=True)
        # keys stay invariant: the same on every device, folded per device in call_loss
        model_state = jax.tree.map(lambda x: x if rng.is_key(x) else varying(x), model_state)
        if grad_accum == 1:
            grads, (loss, model_state, aux) = grad_fn(diff, model_state, batch)
        else:  # accumulate in fp32; stages 2/3 reduce-scatter every micro-batch
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

            def accumulate(carry, micro_batch):
                loss_sum, grads_sum, model_state = carry
                grads, (loss, model_state, aux) = grad_fn(diff, model_state, micro_batch)
                grads = [a + g.astype(a.dtype) for a, g in zip(grads_sum, grads)]
                if isinstance(loss, Weighted):  # totals carried, counts stacked
                    return (loss_sum + loss.total, grads, model_state), (aux, loss.count)
                return (loss_sum + loss, grads, model_state), (aux, None)

            zeros = [varying(jnp.zeros(jax.typeof(x).shape, jnp.float32)) for x in diff]
            init = (varying(jnp.zeros((), jnp.float32)), zeros, model_state)
            (loss, grads, model_state), (aux, counts) = jax.lax.scan(accumulate, init, micro)
            loss = loss / grad_accum if counts is None else Weighted(loss, counts.sum(0))
            aux = jax.tree.map(_combine_micro, aux)
            grads = [g.astype(reduce_dtype) for g in grads]
        if plan.partitions_opt_state and not plan.partitions_grads:
            # P_os alone: the whole local gradient exists before any of it is reduced
            grads = after(grads, [g.reshape(-1)[:1] for g in grads])
        quant = precision.grad_quantizer
        grads = [_reduce(plan, g.astype(reduce_dtype), lay, quant) for g, lay in zip(grads, lays)]
        model_state = jax.tree.map(lambda x: _agree(x, axes), model_state)
        aux = jax.tree.map(lambda x: _agree_aux(x, axes), aux)
        if isinstance(loss, Weighted):
            loss = Weighted(jax.lax.psum(loss.total, axes), jax.lax.psum(loss.count, axes))
        else:
            loss = jax.lax.pmean(loss, axes)
        return loss, jax.tree.unflatten(plan.params_def, grads), model_state, aux

    return body


def _agree(x: jax.Array, axes) -> jax.Array:
    """One value of a model-state leaf on every device: the mean of floats (e.g. batch
    statistics, as synchronised batch norm would give), the max of integers (counters);
    PRNG keys are never averaged (:func:`.rng.agree`: device 0's where they differ)."""
    if rng.is_key(x):
        return rng.agree(x, axes)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.pmax(x, axes)


def _combine_micro(x: jax.Array) -> jax.Array:
    """Aux over micro-batches (leading axis): the mean of floats, the sum of integers."""
    return x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x.sum(0)


def _agree_aux(x: jax.Array, axes) -> jax.Array:
    """Aux over devices: the mean of floats (per-batch metrics), the sum of integers (counts)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.psum(x, axes)


def _reduce(plan: Plan, g: jax.Array, lay: LeafLayout, quant: Quant | None) -> jax.Array:
    """Sum over the data group (all-reduce, or this device's reduce-scattered shard, sent
    quantized with ``quant``), then, when hybrid, across replicas: an all-reduce of what
    the data group left on the device."""
    if not lay.sharded:
        g = jax.lax.psum(g, DATA)  # stage 0, and small replicated leaves
    elif not plan.partitions_grads:
        g = reduce_scatter(g, lay, quant)  # P_os: once, after backward
    # stages 2/3: reduce-scattered already, inside backward
    if plan.hybrid:
        g = jax.lax.psum(g, REPLICA)
    return g
