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
from typing import Any

import jax
import jax.numpy as jnp

from ..internal.moved import InternalMoved, refusal
from ..internal.unbound_axes import vmapped_collectives
from ..internal.vmap_axes import without_vma_checks
from . import rng
from .axis_aliases import aliased, as_tuple, explain_unknown_axis
from .comm.collectives import after
from .comm.gatherer import Gatherer, Sharded
from .comm.reducer import Reducer
from .gather.autogather import gather_where_used
from .grad_average import dtype_for
from .grad_reduction import agree, agree_aux, combine_micro, reduce
from .leaf_layout import LeafLayout
from .loss_protocol import check_loss, split_model_state
from .mesh import DATA, REPLICA
from .options.step import StepOptions
from .plan import Plan
from .weighted import Weighted


def _local_shape(lay: LeafLayout) -> tuple[int, ...]:
    shape = list(lay.padded)
    shape[lay.dim] //= jax.lax.axis_size(DATA)
    return tuple(shape)


def local_grads(
    plan: Plan,
    loss_fn: Callable,
    options: StepOptions,
    gatherer: Gatherer,
    reducer: Reducer,
    *,
    aliases: tuple[str, ...] = (),
):
    """The shard_map body: (params at rest, model state, loss scale, local batch) ->
    (loss, reduced gradients summed over devices and micro-batches, their host copies made
    in backward (per leaf, or None: :meth:`.Reducer.host_copied`), agreed model state, aux).

    ``gatherer`` gathers the parameters where the loss uses them (stage 3) and ``reducer``
    reduce-scatters their gradients (stages 1-3), as the step built them from its
    configuration.

    The loss comes back as the mean over devices, or as a :class:`Weighted` of global sums
    when ``loss_fn`` returns one. ``aliases``: the model's names for the batch axes
    (:mod:`.axis_aliases`; the shard_map's mesh must have them, as ``alias_mesh`` makes it).
    """
    axes = plan.batch_axes  # 'data', or ('replica', 'data') when hybrid
    call_loss = _loss_caller(plan, loss_fn, options, aliases)

    def body(params, model_state, scale, batch):
        diff, wrap = _differentiated(plan, params, gatherer, reducer)
        local_loss = _local_loss(plan, call_loss, wrap, scale, options, gatherer)
        grad_fn = jax.grad(local_loss, has_aux=True)
        # keys stay invariant: the same on every device, folded per device in call_loss
        model_state = jax.tree.map(lambda x: x if rng.is_key(x) else _varying(x, axes), model_state)
        if options.grad_accum == 1:
            grads, (loss, model_state, aux) = grad_fn(diff, model_state, batch)
        else:
            grads, (loss, model_state, aux) = _accumulated(
                grad_fn, diff, model_state, batch, options.grad_accum, axes
            )
        copies = tuple(g[1] if isinstance(g, tuple) else None for g in grads)
        grads = [_cast(g[0] if isinstance(g, tuple) else g, reducer.dtype) for g in grads]
        if plan.config.partitions_opt_state and not plan.config.partitions_grads:
            # P_os alone: the whole local gradient exists before any of it is reduced
            grads = after(grads, [g.reshape(-1)[:1] for g in grads], zero_once=True)
        grads = [reduce(plan, g, lay, reducer) for g, lay in zip(grads, plan.layouts)]
        model_state = jax.tree.map(lambda x: agree(x, axes), model_state)
        aux = jax.tree.map(lambda x: agree_aux(x, axes), aux)
        if isinstance(loss, Weighted):
            loss = Weighted(jax.lax.psum(loss.total, axes), jax.lax.psum(loss.count, axes))
        else:
            loss = jax.lax.pmean(loss, axes)
        return loss, jax.tree.unflatten(plan.params_def, grads), copies, model_state, aux

    return body


_ALIAS_FIX = (
    "name the model's batch axis 'data' (e.g. nn.BatchNorm(axis_name='data')) and drop "
    "axis_name=, or install a JAX that jzero supports (pyproject.toml's range)"
)
_VMAP_FIX = (
    "reduce over the vmapped dimension outside the vmap (e.g. jnp.mean of its result) "
    "instead of a named collective inside it, or install a JAX that jzero supports"
)


def _reduces_over_own_vmap(loss_fn: Callable, args: tuple, axis_sizes: dict) -> bool:
    """Whether ``loss_fn`` reduces over an axis its own ``jax.vmap`` binds; False where the
    internals that tell have moved (the loss's own error then stands)."""
    try:
        return bool(vmapped_collectives(loss_fn, args, axis_sizes))
    except InternalMoved:
        return False


def _varying(x: jax.Array, axes) -> jax.Array:
    """Differentiating a replicated input inside shard_map would psum its gradient
    implicitly; differentiate a varying copy instead and reduce explicitly."""
    return jax.lax.pcast(x, axes, to="varying")


def _loss_caller(plan: Plan, loss_fn: Callable, options: StepOptions, aliases) -> Callable:
    """``call_loss(params, model_state, batch) -> (loss, model_state, aux)``: the user's
    loss under the step's protocol (model state, aux, per-device keys, axis aliases, and
    collectives over the loss's own vmap axes)."""
    axes = plan.batch_axes
    user_fn = (
        loss_fn
        if not aliases
        else aliased(loss_fn, aliases=aliases, axes=as_tuple(axes), size=plan.dp_size)
    )
    axis_sizes = {**plan.mesh.shape, **dict.fromkeys(aliases, plan.dp_size)}

    def user_loss(*args):
        try:
            return user_fn(*args)
        except InternalMoved as moved:
            raise refusal(f"StepOptions(axis_name={aliases!r})", moved, _ALIAS_FIX) from None
        except Exception as e:
            if _reduces_over_own_vmap(loss_fn, args, axis_sizes):
                try:
                    return without_vma_checks(user_fn)(*args)
                except InternalMoved as moved:
                    raise refusal(
                        "a collective over the loss's own jax.vmap axis", moved, _VMAP_FIX
                    ) from None
            explain_unknown_axis(e, loss_fn, args, axis_sizes)  # over an axis the step lacks
            raise

    def call_loss(params, model_state, batch):
        if options.with_model_state:
            seen = rng.for_device(model_state, axes) if options.per_device_rng else model_state
            out, new_state = split_model_state(user_loss(params, seen, batch))
            model_state = rng.settle(new_state, seen=seen, given=model_state, axes=axes)
        else:
            out = user_loss(params, batch)
        loss, aux = check_loss(out, has_aux=options.has_aux)
        return loss, model_state, aux

    return call_loss


def _differentiated(plan: Plan, params, gatherer: Gatherer, reducer: Reducer):
    """What backward differentiates, and how the loss sees it: ``(diff, wrap)``.

    Stages 2/3 differentiate zero "sinks" that receive the reduce-scattered gradients; the
    parameters enter the loss through :class:`Sharded` handles (``wrap``). A leaf whose
    gradient backward copies to host memory (:meth:`.Reducer.host_copied`) has a pair of
    sinks, ``(device, host)``. Stages 0/1 differentiate a varying copy of each parameter."""
    axes, leaves = plan.batch_axes, jax.tree.leaves(params)
    if not plan.config.partitions_grads:
        return [_varying(x, axes) for x in leaves], lambda d: d
    sink = lambda x, lay: _varying(jnp.zeros(_local_shape(lay), _cast_dtype(x, reducer)), axes)
    host = lambda x: jax.device_put(x, jax.memory.Space.Host)
    sinks = lambda x, lay, c: (sink(x, lay), host(sink(x, lay))) if c else sink(x, lay)
    copied = reducer.host_copied(plan)
    diff = [
        sinks(x, lay, c) if lay.sharded else _varying(x, axes)
        for x, lay, c in zip(leaves, plan.layouts, copied)
    ]
    if plan.hybrid:  # varying over 'replica' like the batch, so that the
        # cotangent reaching the handle is this device's alone (no implicit psum)
        leaves = [jax.lax.pcast(x, REPLICA, to="varying") for x in leaves]
    handle = lambda s, x, lay: (
        Sharded(s[0], x, lay, gatherer, reducer, host_copy=s[1])
        if isinstance(s, tuple)
        else Sharded(s, x, lay, gatherer, reducer)
    )
    wrap = lambda d: [
        handle(s, x, lay) if lay.sharded else s for s, x, lay in zip(d, leaves, plan.layouts)
    ]
    return diff, wrap


def _local_loss(plan, call_loss, wrap, scale, options: StepOptions, gatherer: Gatherer):
    """``local_loss(diff, model_state, batch) -> (scaled loss, (loss, model_state, aux))``,
    gathering stage 3's parameters where they are used unless the loss gathers itself."""

    def local_loss(d, model_state, micro_batch):
        p = jax.tree.unflatten(plan.params_def, wrap(d))
        if options.manual_gather or not plan.config.partitions_grads:
            run = call_loss  # it gathers itself, or stages 0/1: it sees no handle
        elif plan.config.partitions_params:  # gather each parameter where it is used
            run = gather_where_used(
                call_loss, prefetch=gatherer.prefetch, policy=options.remat_policy
            )
        else:  # stage 2 reduce-scatters each leaf where backward completes it, and a
            # scanned stack's layer by layer, inside the backward loop
            run = gather_where_used(call_loss, scans_only=True)
        loss, model_state, aux = run(p, model_state, micro_batch)
        if isinstance(loss, Weighted):  # differentiate the sum; divided globally later
            return loss.total * scale, (loss, model_state, aux)
        loss = loss.astype(jnp.float32)
        return loss * scale, (loss, model_state, aux)

    # Without remat_policy, what forward gathers whole and holds is gathered again in
    # backward (gather_where_used's checkpoint). With manual_gather the user's per-layer
    # remat (jax.checkpoint / nn.remat around the layer that calls jzero.gather)
    # re-gathers instead, and with remat_policy each scan step's checkpoint does: an
    # outer policy would override theirs (the outermost checkpoint decides what is saved:
    # a nothing_saveable inside it recomputes nothing, and as the outer policy it would
    # recompute the whole forward).
    return local_loss


def _accumulated(grad_fn, diff, model_state, batch, grad_accum: int, axes):
    """Gradients summed in fp32 over ``grad_accum`` micro-batches (``lax.scan``); stages 2/3
    reduce-scatter every micro-batch inside ``grad_fn``."""
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

    def accumulate(carry, micro_batch):
        loss_sum, grads_sum, model_state = carry
        grads, (loss, model_state, aux) = grad_fn(diff, model_state, micro_batch)
        grads = [a + g.astype(a.dtype) for a, g in zip(grads_sum, grads)]
        if isinstance(loss, Weighted):  # totals carried, counts stacked
            return (loss_sum + loss.total, grads, model_state), (aux, loss.count)
        return (loss_sum + loss, grads, model_state), (aux, None)

    zeros = [_varying(jnp.zeros(x.shape, dtype_for(x, jnp.float32)), axes) for x in diff]
    init = (_varying(jnp.zeros((), jnp.float32), axes), zeros, model_state)
    (loss, grads, model_state), (aux, counts) = jax.lax.scan(accumulate, init, micro)
    loss = loss / grad_accum if counts is None else Weighted(loss, counts.sum(0))
    return grads, (loss, model_state, jax.tree.map(combine_micro, aux))


def _cast(grad: jax.Array, real: Any) -> jax.Array:
    """A local gradient in the reduce dtype (its complex form for a complex gradient)."""
    return grad.astype(dtype_for(grad, real))


def _cast_dtype(param: jax.Array, reducer: Reducer) -> Any:
    """The dtype ``param``'s gradient is reduced in (:func:`_cast`'s)."""
    return dtype_for(param, reducer.dtype)
