"""The training step: forward/backward under ``shard_map``, then the global-view Optax update.

Per stage, inside ``shard_map`` over 'data' (local view):

- 0: grads of the local loss, ``psum`` (all-reduce) over 'data'.
- 1: grads of the local loss, held whole until backward ends, then ``psum_scatter``
  (reduce-scatter) leaf by leaf; the updated shards are ``all_gather``-ed afterwards.
- 2: each sharded leaf enters the loss through :class:`Sharded`, whose backward
  reduce-scatters that leaf's gradient as soon as backward produces it.
- 3: each sharded leaf is ``all_gather``-ed where used (:func:`gather`); backward gathers
  it again (remat) and its transpose reduce-scatters the gradient.

Leaves below the size threshold are replicated and their gradients ``psum``-ed. The Optax
update then runs under ``jit`` on the sharded arrays with the padding sliced off, so every
transformation keeps its single-device meaning; XLA adds only scalar all-reduces (norms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ._collectives import Sharded, after, all_gather, gather, reduce_scatter, regather_policy
from ._layout import LeafLayout, Plan, pad, unpad
from ._mesh import DATA
from ._precision import Precision
from ._state import ZeroState

if TYPE_CHECKING:
    from ._optimizer import ZeroOptimizer


def _varying(x: jax.Array) -> jax.Array:
    # Differentiating a replicated input inside shard_map would psum its gradient
    # implicitly; differentiate a varying copy instead and reduce explicitly.
    return jax.lax.pcast(x, DATA, to="varying")


def _check_batch(batch: Any, n: int, grad_accum: int) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError("batch is empty; pass a pytree of arrays with a leading batch axis.")
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}; its leading "
                f"(batch) dimension must be divisible by the data-axis size {n}. Use a batch "
                f"size that is a multiple of {n}."
            )
        if shape[0] % (n * grad_accum):
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has {shape[0]} rows, which do not "
                f"split into {grad_accum} micro-batches on each of {n} devices; use a batch "
                f"size that is a multiple of {n * grad_accum} or change grad_accum."
            )


def _local_grads(
    plan: Plan, loss_fn: Callable, manual_gather: bool, grad_accum: int, precision: Precision
):
    """The shard_map body: (params at rest, model state, loss scale, local batch) ->
    (loss, reduced gradients summed over devices and micro-batches, agreed model state).

    ``loss_fn(params, model_state, batch) -> (loss, model_state)``.
    """
    stage, lays, reduce_dtype = plan.stage, plan.params, precision.reduce_dtype

    def body(params, model_state, scale, batch):
        leaves = jax.tree.leaves(params)
        if stage in (0, 1):
            diff = [_varying(x) for x in leaves]
            wrap = lambda d: d
        else:  # differentiate zero "sinks" that receive the reduce-scattered gradients
            sink = lambda x, lay: _varying(jnp.zeros(_local_shape(lay), reduce_dtype))
            diff = [sink(x, lay) if lay.sharded else _varying(x) for x, lay in zip(leaves, lays)]
            shard = (lambda x: x) if stage == 3 else (lambda x: None)
            full = (lambda x: None) if stage == 3 else (lambda x: x)
            wrap = lambda d: [
                Sharded(s, shard(x), full(x), lay) if lay.sharded else s
                for s, x, lay in zip(d, leaves, lays)
            ]

        def local_loss(d, model_state, micro_batch):
            p = jax.tree.unflatten(plan.params_def, wrap(d))
            loss, model_state = loss_fn(p if manual_gather else gather(p), model_state, micro_batch)
            return loss.astype(jnp.float32) * scale, (loss.astype(jnp.float32), model_state)

        if stage == 3 and not manual_gather:
            # Everything is gathered up front: remat just the gathers, so backward gathers
            # again. With manual_gather the user's per-layer remat (jax.checkpoint /
            # nn.remat around the layer that calls jzero.gather) re-gathers instead; an
            # outer policy here would override it and keep the layers' activations.
            local_loss = jax.checkpoint(local_loss, policy=regather_policy)
        grad_fn = jax.grad(local_loss, has_aux=True)
        model_state = jax.tree.map(_varying, model_state)
        if grad_accum == 1:
            grads, (loss, model_state) = grad_fn(diff, model_state, batch)
        else:  # accumulate in fp32; stages 2/3 reduce-scatter every micro-batch
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

            def accumulate(carry, micro_batch):
                loss_sum, grads_sum, model_state = carry
                grads, (loss, model_state) = grad_fn(diff, model_state, micro_batch)
                grads = [a + g.astype(a.dtype) for a, g in zip(grads_sum, grads)]
                return (loss_sum + loss, grads, model_state), None

            zeros = [_varying(jnp.zeros(jax.typeof(x).shape, jnp.float32)) for x in diff]
            init = (_varying(jnp.zeros((), jnp.float32)), zeros, model_state)
            (loss, grads, model_state), _ = jax.lax.scan(accumulate, init, micro)
            loss = loss / grad_accum
            grads = [g.astype(reduce_dtype) for g in grads]
        if stage == 1:  # P_os: the whole local gradient exists before any of it is reduced
            grads = after(grads, [g.reshape(-1)[:1] for g in grads])
        grads = [_reduce(g.astype(reduce_dtype), lay, stage) for g, lay in zip(grads, lays)]
        model_state = jax.tree.map(_agree, model_state)
        return jax.lax.pmean(loss, DATA), jax.tree.unflatten(plan.params_def, grads), model_state

    return body


def _agree(x: jax.Array) -> jax.Array:
    """One value of a model-state leaf on every device: the mean of floats (e.g. batch
    statistics, as synchronised batch norm would give), the max of integers (counters)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, DATA)
    return jax.lax.pmax(x, DATA)


def _local_shape(lay: LeafLayout) -> tuple[int, ...]:
    shape = list(lay.padded)
    shape[lay.dim] //= jax.lax.axis_size(DATA)
    return tuple(shape)


def _reduce(g: jax.Array, lay: LeafLayout, stage: int) -> jax.Array:
    if not lay.sharded:
        return jax.lax.psum(g, DATA)  # stage 0, and small replicated leaves
    if stage == 1:
        return reduce_scatter(g, lay)
    return g  # stages 2, 3: reduce-scattered already, inside backward


def make_train_step(
    opt: ZeroOptimizer,
    loss_fn: Callable[..., Any],
    *,
    manual_gather: bool = False,
    grad_accum: int = 1,
    with_model_state: bool = False,
    donate: bool = True,
) -> Callable[[ZeroState, Any], tuple[ZeroState, dict[str, jax.Array]]]:
    """Builds the jitted ``step(state, batch) -> (state, metrics)``.

    Args:
        opt: the optimizer.
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over its batch. It runs
            per device on that device's slice of the batch (leading axis split over 'data').
        manual_gather: if False (default), stage 3 gathers every parameter at the start of
            the forward pass. If True, ``loss_fn`` receives :class:`Sharded` handles in stages
            2/3 and calls :func:`jzero.gather` on each layer's parameters where it uses them,
            inside a rematerialised layer (``jax.checkpoint`` / ``nn.remat``), so stage 3
            holds about one layer's gathered parameters at a time and backward gathers again.
            Call ``gather`` once per parameter and forward pass: each call is one
            reduce-scatter of that parameter's gradient in backward (stages 2/3).
        grad_accum: split each device's batch into this many micro-batches and accumulate
            their gradients in fp32 inside the step (``lax.scan``). Stages 0/1 keep a
            full-size local accumulator and communicate once per step; stages 2/3 keep only
            their 1/N shard and reduce-scatter every micro-batch (more, smaller messages
            for 1/N of the accumulator memory).
        with_model_state: the loss also reads and updates non-trainable model state
            (``state.model_state``, e.g. Flax ``batch_stats``), replicated over 'data':
            ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``. jzero then
            makes the new state agree on every device (mean of floats, max of integers).
        donate: donate the old state's buffers to the new one.

    ``metrics`` holds ``loss`` (mean over the global batch), ``grad_norm`` (global L2 norm
    of the averaged gradient, padding excluded) and, with dynamic loss scaling,
    ``loss_scale`` and ``skipped`` (1 where non-finite gradients skipped the update).
    """
    mesh, n, stage, precision = opt.mesh, opt.data_size, opt.stage, opt.precision
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}.")
    if with_model_state:
        inner_loss = loss_fn
    else:
        inner_loss = lambda params, model_state, batch: (loss_fn(params, batch), model_state)

    def step(state: ZeroState, batch: Any):
        opt.check_state(state)
        _check_batch(batch, n, grad_accum)
        plan = state.plan
        lays = plan.params_tree()
        rest = lambda lay: lay.data_spec() if stage == 3 else P()
        grad_spec = lambda lay: lay.data_spec() if stage >= 1 else P()
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
        fwd_bwd = jax.shard_map(
            _local_grads(plan, inner_loss, manual_gather, grad_accum, precision),
            mesh=mesh,
            in_specs=(
                jax.tree.map(rest, lays),
                jax.tree.map(lambda _: P(), state.model_state),
                P(),
                jax.tree.map(lambda _: P(DATA), batch),
            ),
            out_specs=(P(), jax.tree.map(grad_spec, lays), P()),
            axis_names={DATA},
        )
        loss, grads, model_state = fwd_bwd(state.params, state.model_state, scale, batch)
        # Global view from here: sums -> means (and unscaled), padding sliced off.
        grads = jax.tree.map(
            lambda g, lay: unpad(g.astype(jnp.float32) / (n * grad_accum * scale), lay),
            grads,
            lays,
        )
        new_state = _update(opt, state, grads)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if state.loss_scale is not None:
            finite = jnp.isfinite(metrics["grad_norm"])
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
            new_state = new_state.replace(loss_scale=state.loss_scale.next(finite, precision))
            metrics |= {"loss_scale": scale, "skipped": (~finite).astype(jnp.int32)}
        return new_state.replace(step=state.step + 1, model_state=model_state), metrics

    return jax.jit(step, donate_argnums=0 if donate else ())


def _update(opt: ZeroOptimizer, state: ZeroState, grads: Any) -> ZeroState:
    """The Optax update in the global view, on fp32 master weights, then re-placement."""
    plan, stage, precision = state.plan, opt.stage, opt.precision
    lays, opt_lays = plan.params_tree(), plan.opt_tree()
    if precision.mixed:
        master = jax.tree.map(unpad, state.master, lays)
    else:
        master = state.params if stage < 3 else jax.tree.map(unpad, state.params, lays)
    opt_state = jax.tree.map(unpad, state.opt_state, opt_lays)
    updates, opt_state = opt.tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)

    shardings = opt.state_shardings(plan)
    opt_state = jax.lax.with_sharding_constraint(
        jax.tree.map(pad, opt_state, opt_lays), shardings.opt_state
    )
    params = precision.cast(master)
    if stage in (1, 2):
        params = _all_gather_params(opt, plan, params)
    params = jax.lax.with_sharding_constraint(opt.store_params(params, plan), shardings.params)
    if precision.mixed:
        master = jax.lax.with_sharding_constraint(jax.tree.map(pad, master, lays), shardings.master)
    else:
        master = None
    return state.replace(params=params, opt_state=opt_state, master=master)


def _all_gather_params(opt: ZeroOptimizer, plan: Plan, params: Any) -> Any:
    """Stages 1/2: updated shards -> full replicated parameters, by explicit all-gather."""
    lays = plan.params_tree()
    sharded = jax.tree.map(
        lambda p, lay: jax.lax.with_sharding_constraint(pad(p, lay), opt._sharding(lay.spec)),
        params,
        lays,
    )
    gather_fn = jax.shard_map(
        lambda ps: [all_gather(p, lay) if lay.sharded else p for p, lay in zip(ps, plan.params)],
        mesh=opt.mesh,
        in_specs=([lay.data_spec() for lay in plan.params],),
        out_specs=[P()] * len(plan.params),
        axis_names={DATA},
        check_vma=False,  # all_gather's result is replicated; vma cannot infer that
    )
    return jax.tree.unflatten(plan.params_def, gather_fn(jax.tree.leaves(sharded)))
