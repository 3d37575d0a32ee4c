"""The training step: forward/backward under ``shard_map``, then the global-view Optax update.

Forward/backward runs in the local view (:mod:`.local_grads`: the collectives per stage, over
'data', and across 'replica' when the mesh is hybrid). The Optax update then runs under
``jit`` on the sharded arrays with the padding sliced off, so every transformation keeps
its single-device meaning; XLA adds only scalar all-reduces (norms). In stages 1/2 the
updated shards are ``all_gather``-ed afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .agreement import Agreement
from .axis_aliases import alias_mesh, check_aliases
from .batch_sharding import check_batch_sharding
from .checks import check_batch, check_global_batch, check_live, check_state
from .comm.collectives import all_gather
from .communication import Communication
from .leaf_layout import pad, unpad
from .local_grads import local_grads
from .memory_kinds import check_state_offload
from .mesh_types import on_compute_mesh, typed
from .offload.host_step import Gradients, host_update
from .offload.options import NO_OFFLOAD, Offload
from .offload.update import offloaded_update
from .plan import Plan
from .precision import Precision
from .step_options import StepOptions
from .stored_form import constrain, store, to_device, typed_state, view
from .weighted import CountWatch, Weighted, counted, divisor, skip_uncounted
from .zero_state import ZeroState

Metrics = dict[str, Any]


class TrainStep:
    """The jitted ``step(state, batch) -> (state, metrics)``, refusing a consumed state.

    In a run of several processes it first compares, once per new batch layout, the
    configuration every process runs with (:mod:`.agreement`: a mismatch is named on every
    process instead of hanging in the first collective), then refuses a global batch that
    is not split over the mesh's batch axes (:mod:`.batch_sharding`).

    ``lower(state, batch)`` gives the jitted program's lowering (for
    :func:`jzero.report` and ``.compile().memory_analysis()``); ``comm`` the
    :class:`.Communication` its collectives follow (the report reads hpZ's groups from it).
    """

    def __init__(
        self, jitted: Any, donate: bool, *, mesh: Mesh, agreement: Agreement, comm: Communication
    ):
        self._jitted, self._donate, self.comm = jitted, donate, comm
        self._mesh, self._agreement = mesh, agreement
        self._counts = CountWatch()  # raises for an earlier step's invalid Weighted count

    def __call__(self, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        # First, so that the checks below fail alike on every process (multi-process runs:
        # one small gather per new batch layout, before the step's first collective).
        self._agreement.check(state, batch)
        check_live(state)
        check_global_batch(batch)
        check_batch_sharding(batch, self._mesh)
        self._counts.check()
        state, metrics = self._jitted(state, batch)
        self._counts.watch(metrics)
        return state, metrics

    def lower(self, state: ZeroState, batch: Any) -> Any:
        check_live(state)
        return self._jitted.lower(state, batch)


def make_train_step(
    loss_fn: Callable[..., Any],
    options: StepOptions,
    *,
    tx: optax.GradientTransformation,
    precision: Precision,
    comm: Communication,
    mesh: Mesh,
    stage: int,
    offload: Offload = NO_OFFLOAD,
) -> TrainStep:
    """Builds the jitted ``step(state, batch) -> (state, metrics)`` for ``state.plan``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over its batch. It runs
            per device on that device's slice of the batch (leading axis split over 'data').
            With ``options.has_aux``, it returns ``(loss, aux)``. It may return a
            :class:`jzero.Weighted` ``(total, count)`` in place of the mean: the step then
            sums both over devices and micro-batches and trains on their quotient, the
            global-batch objective whatever the number of tokens on each device.
        options: how the loss is called and what the step keeps (:class:`.StepOptions`).
        tx, precision, comm: the optimizer's Optax transformation, precision policy and
            collectives (:class:`.Communication`).
        mesh, stage, offload: what the state must have been made for (checked at trace
            time, with ``precision`` and ``tx``: a state from another optimizer is refused,
            and so is one whose leaves are not in the memory its plan stores them in).

    ``metrics`` holds ``loss`` (mean over the global batch), ``grad_norm`` (global L2 norm
    of the averaged gradient, padding excluded) and, with dynamic loss scaling,
    ``loss_scale`` and ``skipped`` (1 where non-finite gradients skipped the update); with
    a :class:`Weighted` loss, ``count`` (the global count) and ``skipped`` (1 also where a
    negative or non-finite count skipped the step; see :class:`Weighted`).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    options.check_stage(stage)
    aliases = check_aliases(options.axis_name, mesh.axis_names)

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        check_state(state, stage=stage, mesh=mesh, mixed=precision.mixed, tx=tx)
        check_state_offload(state, offload)
        check_batch(batch, state.plan.dp_size, options.grad_accum)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
        body = local_grads(state.plan, loss_fn, options, precision, comm, aliases=aliases)
        loss, grads, model_state, aux = _sharded(body, state, scale, batch, aliases)
        loss, grads, ok = _global_view(state.plan, loss, grads, scale, options.grad_accum)
        return _apply(tx, precision, state, (loss, grads, model_state, aux), scale, ok, options)

    given = {"options": options, "comm": comm, "offload": offload}
    agreement = Agreement(stage=stage, mesh=mesh, precision=precision, options=given)
    jitted = jax.jit(_on_mesh(step, mesh), donate_argnums=0 if options.donate else ())
    return TrainStep(jitted, options.donate, mesh=mesh, agreement=agreement, comm=comm)


def _sharded(body: Callable, state: ZeroState, scale: jax.Array, batch: Any, aliases) -> tuple:
    """Runs the local view ``body`` under ``shard_map``: (loss, reduced grads, agreed
    model state, aux), each replicated or sharded as its plan says."""
    plan = state.plan
    grad_specs = [lay.data_spec() if plan.partitions_opt_state else P() for lay in plan.layouts]
    fwd_bwd = jax.shard_map(
        body,
        mesh=alias_mesh(plan.compute_mesh, aliases) if aliases else plan.compute_mesh,
        in_specs=(
            jax.tree.unflatten(plan.params_def, [s.data_spec for s in plan.params]),
            jax.tree.map(lambda _: P(), state.model_state),
            P(),
            jax.tree.map(lambda _: P(plan.batch_axes), batch),
        ),
        out_specs=(P(), jax.tree.unflatten(plan.params_def, grad_specs), P(), P()),
        axis_names=set(plan.manual_axes) | set(aliases),
    )
    loss, grads, model_state, aux = fwd_bwd(state.params, state.model_state, scale, batch)
    if aliases:  # back from the alias mesh onto the state's own (one compiled step)
        loss, model_state, aux = jax.lax.with_sharding_constraint(
            (loss, model_state, aux), plan.compute_sharding(P())
        )
    return loss, grads, model_state, aux


def _global_view(plan: Plan, loss: Any, grads: Any, scale: jax.Array, grad_accum: int) -> tuple:
    """Sums over devices -> means (unscaled, padding sliced off; kept beside the reduced
    sums, which the host step reads). With a :class:`Weighted` loss, also whether its
    global count is valid (else None)."""
    ok = None
    if isinstance(loss, Weighted):  # global sums: divide by the global count
        ok = counted(loss.count)
        loss = Weighted(loss.total / divisor(loss.count), loss.count)
        denominator = divisor(loss.count) * scale
    else:
        denominator = plan.dp_size * grad_accum * scale
    averaged = jax.tree.map(
        lambda g, lay: unpad(g.astype(jnp.float32) / denominator, lay),
        grads,
        plan.params_tree(),
    )
    return loss, Gradients(grads, denominator, averaged), ok


def _apply(tx, precision, state, outputs, scale, ok, options) -> tuple[ZeroState, Metrics]:
    """The update (skipped where gradients or the count are not finite), and the metrics."""
    loss, grads, model_state, aux = outputs
    count = loss.count if isinstance(loss, Weighted) else None
    loss = loss.total if isinstance(loss, Weighted) else loss
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads.averaged)}
    finite = None
    if state.loss_scale is not None:  # non-finite gradients: the update keeps the state
        finite = jnp.isfinite(metrics["grad_norm"])
    keep = ok if finite is None else (finite if ok is None else finite & ok)
    new_state = _update(tx, precision, state, grads, keep)
    if options.has_aux:
        metrics["aux"] = aux
    if finite is not None:
        new_state = new_state.replace(loss_scale=state.loss_scale.next(finite, precision))
        metrics |= {"loss_scale": scale, "skipped": (~finite).astype(jnp.int32)}
    new_state = new_state.replace(step=state.step + 1, model_state=model_state)
    if ok is not None:
        new_state, metrics = skip_uncounted(ok, count, state, new_state, metrics)
    return new_state, metrics


def _on_mesh(step: Callable, mesh: Mesh) -> Callable:
    """``step`` computed on the compute mesh, its results typed with ``mesh`` again
    (:mod:`.mesh_types`: only types change on a mesh with ``Explicit`` axes)."""
    compute = on_compute_mesh(step, mesh)

    @functools.wraps(step)
    def typed_step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        new_state, metrics = compute(state, batch)
        replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), metrics)
        return typed_state(new_state), typed(metrics, replicated)

    return typed_step


def _update(
    tx: optax.GradientTransformation,
    precision: Precision,
    state: ZeroState,
    grads: Gradients,
    finite: jax.Array | None,
) -> ZeroState:
    """The Optax update in the global view, on fp32 master weights, then re-placement.

    Where ``finite`` is False (non-finite gradients under dynamic loss scaling, or an
    invalid :class:`Weighted` count) the step keeps the old parameters, Optax state and
    master weights. With an offloaded optimizer the state streams through the device
    (:func:`.offload.update.offloaded_update`), or is updated on the host
    (:func:`.offload.host_step.host_update`). With stage 3's parameters (and master
    weights) offloaded and the optimizer on the device, they stream through the device
    the same way, one piece at a time: the update never copies every weight in at once.
    """
    plan = state.plan
    weights = state.master if plan.master is not None else state.params
    if plan.host_step:
        params, opt_state, master = host_update(
            tx, precision, plan, grads, state.opt_state, weights, finite
        )
    elif plan.offloads or plan.offloads_params:  # piece by piece, never all weights at once
        params, opt_state, master = offloaded_update(
            tx, precision, plan, grads, state.opt_state, weights, finite
        )
    else:
        params, opt_state, master = _device_update(
            tx, precision, plan, grads.averaged, state.opt_state, weights, finite
        )
    if plan.partitions_opt_state and not plan.partitions_params:
        params = _all_gather_params(plan, params)
    params = constrain(plan, store(params, plan.params), plan.params)
    return state.replace(params=params, opt_state=opt_state, master=master)


def _device_update(
    tx: optax.GradientTransformation,
    precision: Precision,
    plan: Plan,
    grads: Any,
    opt_state: Any,
    weights: Any,
    finite: jax.Array | None,
) -> tuple[Any, Any, Any]:
    """The Optax update with the state on the device; as ``offloaded_update``, returns the
    new parameters (true shapes, on the device), the stored Optax state and the stored
    master weights (None without)."""
    stored = plan.master if plan.master is not None else plan.params
    old = view(to_device(plan, weights, stored), stored)
    old_state = view(opt_state, plan.opt)
    updates, opt_state = tx.update(grads, old_state, old)
    master = optax.apply_updates(old, updates)
    if finite is not None:  # the old values where the step is skipped
        keep = lambda new, old: jnp.where(finite, new, old)
        master = jax.tree.map(keep, master, old)
        opt_state = jax.tree.map(keep, opt_state, old_state)
    opt_state = constrain(plan, store(opt_state, plan.opt), plan.opt)
    params = precision.cast(master)
    if plan.master is None:
        return params, opt_state, None
    return params, opt_state, constrain(plan, store(master, plan.master), plan.master)


def _all_gather_params(plan: Plan, params: Any) -> Any:
    """Stages 1/2: updated shards -> full replicated parameters, by explicit all-gather."""
    shards = [
        jax.lax.with_sharding_constraint(pad(p, lay), plan.compute_sharding(lay.spec))
        for p, lay in zip(jax.tree.leaves(params), plan.layouts)
    ]
    gather_fn = jax.shard_map(
        lambda ps: [all_gather(p, lay) if lay.sharded else p for p, lay in zip(ps, plan.layouts)],
        mesh=plan.compute_mesh,
        in_specs=([lay.data_spec() for lay in plan.layouts],),
        out_specs=[P()] * len(plan.layouts),
        axis_names=set(plan.manual_axes),
        check_vma=False,  # all_gather's result is replicated; vma cannot infer that
    )
    return jax.tree.unflatten(plan.params_def, gather_fn(shards))
