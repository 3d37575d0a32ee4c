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

from . import grad_average
from .agreement import Agreement
from .axis_aliases import alias_mesh, check_aliases
from .axis_types import on_compute_mesh, typed
from .batch_sharding import check_batch_sharding
from .comm.collectives import all_gather
from .comm.gatherer import Gatherer
from .comm.reducer import Reducer
from .compile_options import step_compiler_options
from .gpu_target.compile_only import check_runnable
from .grad_reduction import Gradients
from .input_checks import check_batch, check_global_batch, check_live, check_state
from .leaf_layout import pad
from .local_grads import local_grads
from .memory_kinds import check_state_offload
from .options.communication import Communication
from .options.zero_config import ZeroConfig
from .plan import Pending, Plan, ZeroState
from .step_count import StepCount
from .stored_form import constrain, store, to_device, to_host, typed_state
from .updaters import Updater, make_updater
from .weighted import CountWatch, Weighted, check_delayable, counted, divisor, skip_uncounted

Metrics = dict[str, Any]


class TrainStep:
    """The jitted ``step(state, batch) -> (state, metrics)``, refusing a consumed state.

    In a run of several processes it first compares, once per new batch layout, the
    configuration every process runs with (:mod:`.agreement`: a mismatch is named on every
    process instead of hanging in the first collective), then refuses a global batch that
    is not split over the mesh's batch axes (:mod:`.batch_sharding`).

    ``lower(state, batch)`` gives the jitted program's lowering (for
    :func:`jzero.report` and ``.compile().memory_analysis()``); ``config`` the
    :class:`.ZeroConfig` it was built with, and ``comm`` its :class:`.Communication` (the
    report reads hpZ's groups from it).
    """

    def __init__(
        self,
        jitted: Any,
        *,
        config: ZeroConfig,
        mesh: Mesh,
        agreement: Agreement,
        delayed: Any = None,
    ):
        self._jitted, self._delayed, self.config = jitted, delayed, config
        self._mesh, self._agreement = mesh, agreement
        self._counts = CountWatch()  # raises for an earlier step's invalid Weighted count
        self._steps = StepCount()  # Offload(delay=1): which program takes the next step

    def __call__(self, state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        check_runnable(self._mesh, "TrainStep.__call__")
        # First, so that the checks below fail alike on every process (multi-process runs:
        # one small gather per new batch layout, before the step's first collective).
        self._agreement.check(state, batch)
        check_live(state)
        check_global_batch(batch)
        check_batch_sharding(batch, self._mesh)
        self._counts.check()
        step = self._program(state)
        state, metrics = step(state, batch)
        self._steps.taken(state)
        self._counts.watch(metrics)
        return state, metrics

    def lower(self, state: ZeroState, batch: Any, *, platforms: tuple[str, ...] | None = None):
        """The lowering of the program that would take ``state`` 's next step (with
        ``Offload(delay=1)``: the exact one for its first ``exact_steps``, then the delayed
        one). ``platforms``: lower it for these instead of the mesh's devices, e.g.
        ``("cuda",)`` to read on a CPU what a GPU would be given to compile (its text only:
        such a lowering cannot compile here)."""
        check_live(state)
        traced = self._program(state).trace(state, batch)
        return traced.lower(lowering_platforms=platforms)

    def _program(self, state: ZeroState) -> Any:
        if self._delayed is None:
            return self._jitted
        exact = self.config.offload.exact_steps
        return self._delayed if exact == 0 or self._steps.of(state) >= exact else self._jitted

    @property
    def comm(self) -> Communication:
        return self.config.comm


def make_train_step(
    loss_fn: Callable[..., Any], config: ZeroConfig, *, tx: optax.GradientTransformation, mesh: Mesh
) -> TrainStep:
    """Builds the jitted ``step(state, batch) -> (state, metrics)`` for ``state.plan``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over its batch. It runs
            per device on that device's slice of the batch (leading axis split over 'data').
            With ``config.step.has_aux``, it returns ``(loss, aux)``. It may return a
            :class:`jzero.Weighted` ``(total, count)`` in place of the mean: the step then
            sums both over devices and micro-batches and trains on their quotient, the
            global-batch objective whatever the number of tokens on each device.
        config: the run's :class:`.ZeroConfig`; ``config.step`` says how the loss is
            called and what the step keeps (:class:`.StepOptions`).
        tx, mesh: the Optax transformation and the mesh. A state made for another stage,
            mesh, precision, offload or ``tx`` is refused at trace time, and so is one whose
            leaves are not in the memory its plan stores them in.

    ``metrics`` holds ``loss`` (mean over the global batch), ``grad_norm`` (global L2 norm
    of the averaged gradient, padding excluded) and, with dynamic loss scaling,
    ``loss_scale`` and ``skipped`` (1 where non-finite gradients skipped the update); with
    a :class:`Weighted` loss, ``count`` (the global count) and ``skipped`` (1 also where a
    negative or non-finite count skipped the step; see :class:`Weighted`).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    options = config.step
    aliases = check_aliases(options.axis_name, mesh.axis_names)
    # the three strategies, built once: gathering parameters, reducing gradients, updating
    gatherer, reducer, update = Gatherer.of(config), Reducer.of(config), make_updater(tx, config)

    def forward_backward(state: ZeroState, batch: Any, *, scaled: bool) -> tuple:
        """The state and batch checked, then ``(loss, reduced gradients with their host
        copies and means, agreed model state, aux)``, whether a :class:`Weighted` loss's
        global count is valid (else None), and the loss scale (1 unless ``scaled``)."""
        check_state(state, config, mesh=mesh, tx=tx)
        check_state_offload(state, config.offload)
        check_batch(batch, state.plan.dp_size, options.grad_accum)
        scale = jnp.float32(1)
        if scaled and state.loss_scale is not None:
            scale = state.loss_scale.scale
        body = local_grads(state.plan, loss_fn, options, gatherer, reducer, aliases=aliases)
        loss, grads, copies, model_state, aux = _sharded(
            body, state, scale, batch, aliases, reducer
        )
        loss, grads, ok = _global_view(state.plan, loss, (grads, copies), scale, options.grad_accum)
        return (loss, grads, model_state, aux), ok, scale

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        outputs, ok, scale = forward_backward(state, batch, scaled=True)
        return _apply(update, state, outputs, scale, ok, config)

    def delayed_step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        # no dynamic loss scaling with a delay (Offload.check_precision)
        outputs, ok, _ = forward_backward(state, batch, scaled=False)
        check_delayable(ok)
        return _delayed(update, state, outputs, config)

    agreement = Agreement(config, mesh)
    jit = functools.partial(
        jax.jit,
        donate_argnums=0 if options.donate else (),
        compiler_options=step_compiler_options(config, mesh),
    )
    jitted = jit(_on_mesh(step, mesh))
    delayed = jit(_on_mesh(delayed_step, mesh)) if config.offload.delay else None
    return TrainStep(jitted, config=config, mesh=mesh, agreement=agreement, delayed=delayed)


def _sharded(
    body: Callable, state: ZeroState, scale: jax.Array, batch: Any, aliases, reducer: Reducer
) -> tuple:
    """Runs the local view ``body`` under ``shard_map``: (loss, reduced grads with the host
    copies backward made of them, agreed model state, aux), each replicated or sharded as
    its plan says."""
    plan = state.plan
    sharded = plan.config.partitions_opt_state
    grad_specs = [lay.data_spec() if sharded else P() for lay in plan.layouts]
    copied = reducer.host_copied(plan)
    copy_specs = tuple(s if c else None for s, c in zip(grad_specs, copied))
    fwd_bwd = jax.shard_map(
        body,
        mesh=alias_mesh(plan.compute_mesh, aliases) if aliases else plan.compute_mesh,
        in_specs=(
            jax.tree.unflatten(plan.params_def, [s.data_spec for s in plan.params]),
            jax.tree.map(lambda _: P(), state.model_state),
            P(),
            jax.tree.map(lambda _: P(plan.batch_axes), batch),
        ),
        out_specs=(P(), jax.tree.unflatten(plan.params_def, grad_specs), copy_specs, P(), P()),
        axis_names=set(plan.manual_axes) | set(aliases),
    )
    loss, grads, copies, model_state, aux = fwd_bwd(state.params, state.model_state, scale, batch)
    if aliases:  # back from the alias mesh onto the state's own (one compiled step)
        loss, model_state, aux = jax.lax.with_sharding_constraint(
            (loss, model_state, aux), plan.compute_sharding(P())
        )
    return loss, grads, copies, model_state, aux


def _global_view(plan: Plan, loss: Any, reduced: tuple, scale: jax.Array, grad_accum: int) -> tuple:
    """Sums over devices -> means (unscaled, padding sliced off; kept beside the reduced
    sums and their host copies, ``reduced``, which the host step reads). With a
    :class:`Weighted` loss, also whether its global count is valid (else None)."""
    grads, copies = reduced
    ok = None
    if isinstance(loss, Weighted):  # global sums: divide by the global count
        ok = counted(loss.count)
        loss = Weighted(loss.total / divisor(loss.count), loss.count)
        denominator = divisor(loss.count) * scale
    else:
        denominator = plan.dp_size * grad_accum * scale
    averaged = jax.tree.map(
        lambda g, lay: grad_average.averaged(g, denominator, lay),
        grads,
        plan.params_tree(),
    )
    return loss, Gradients(grads, denominator, averaged, _none_if_empty(copies)), ok


def _none_if_empty(copies: tuple) -> tuple | None:
    return None if all(c is None for c in copies) else copies


def _apply(update, state, outputs, scale, ok, config) -> tuple[ZeroState, Metrics]:
    """The update (skipped where gradients or the count are not finite), and the metrics."""
    loss, grads, model_state, aux = outputs
    count = loss.count if isinstance(loss, Weighted) else None
    loss = loss.total if isinstance(loss, Weighted) else loss
    norm, opt_state = update.before(optax.tree.norm(grads.averaged), state.opt_state)
    state = state.replace(opt_state=opt_state)
    metrics = {"loss": loss, "grad_norm": norm}
    finite = None
    if state.loss_scale is not None:  # non-finite gradients: the update keeps the state
        finite = jnp.isfinite(metrics["grad_norm"])
    keep = ok if finite is None else (finite if ok is None else finite & ok)
    new_state = _update(update, state, grads, keep)
    if config.step.has_aux:
        metrics["aux"] = aux
    if finite is not None:
        new_state = new_state.replace(loss_scale=state.loss_scale.next(finite, config.precision))
        metrics |= {"loss_scale": scale, "skipped": (~finite).astype(jnp.int32)}
    new_state = new_state.replace(step=state.step + 1, model_state=model_state)
    if ok is not None:
        new_state, metrics = skip_uncounted(ok, count, state, new_state, metrics)
    return new_state, metrics


def _delayed(update, state, outputs, config) -> tuple[ZeroState, Metrics]:
    """ZeRO-Offload's delayed parameter update: the update applies the gradient the state
    holds (the previous step's; none before the first delayed step has taken one) and this
    step's gradient is held, in host memory, for the next. The update reads nothing this
    step computes, so the host may update while the device runs forward and backward."""
    loss, grads, model_state, aux = outputs
    plan, pending = state.plan, state.pending
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads.averaged)}
    if config.step.has_aux:
        metrics["aux"] = aux
    new_state = _update(update, state, _held(plan, pending), pending.apply)
    held = jax.tree.unflatten(plan.params_def, grads.host_reads())
    held = to_host(plan, held, plan.pending)
    pending = Pending(held, grads.denominator, jnp.ones((), jnp.bool_))
    new_state = new_state.replace(step=state.step + 1, model_state=model_state, pending=pending)
    return new_state, metrics


def _held(plan: Plan, pending: Pending) -> Gradients:
    """The held gradient in the forms the updaters read: as reduced (host memory) and
    averaged (on the device; only where the update's global part or a device bucket
    reads it)."""
    on_device = to_device(plan, pending.grads, plan.pending)
    averaged = jax.tree.map(
        lambda g, lay: grad_average.averaged(g, pending.denominator, lay),
        on_device,
        plan.params_tree(),
    )
    return Gradients(pending.grads, pending.denominator, averaged)


def _on_mesh(step: Callable, mesh: Mesh) -> Callable:
    """``step`` computed on the compute mesh, its results typed with ``mesh`` again
    (:mod:`.axis_types`: only types change on a mesh with ``Explicit`` axes)."""
    compute = on_compute_mesh(step, mesh)

    @functools.wraps(step)
    def typed_step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        new_state, metrics = compute(state, batch)
        replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), metrics)
        return typed_state(new_state), typed(metrics, replicated)

    return typed_step


def _update(update: Updater, state: ZeroState, grads: Gradients, finite) -> ZeroState:
    """The Optax update in the global view (on the fp32 master weights, by ``update``: on
    the device, streamed through it, or on the host; :mod:`.updaters`), then re-placement.

    Where ``finite`` is False (non-finite gradients under dynamic loss scaling, or an
    invalid :class:`Weighted` count) the step keeps the old parameters, Optax state and
    master weights.
    """
    plan = state.plan
    weights = state.master if plan.master is not None else state.params
    params, opt_state, master = update(plan, grads, state.opt_state, weights, finite)
    if plan.config.partitions_opt_state and not plan.config.partitions_params:
        params = _all_gather_params(plan, params, state.params)
    params = constrain(plan, store(params, plan.params), plan.params)
    return state.replace(params=params, opt_state=opt_state, master=master)


def _all_gather_params(plan: Plan, params: Any, old: Any) -> Any:
    """Stages 1/2: updated shards -> full replicated parameters, by explicit all-gather
    (a mixing leaf's from its owner layout, :attr:`Plan.update_layouts`)."""
    layouts = plan.update_layouts
    shards = [
        jax.lax.with_sharding_constraint(pad(p, lay), plan.compute_sharding(lay.spec))
        for p, lay in zip(jax.tree.leaves(params), layouts)
    ]
    gather_fn = jax.shard_map(
        lambda ps, olds: [_gathered(p, lay, o) for p, lay, o in zip(ps, layouts, olds)],
        mesh=plan.compute_mesh,
        in_specs=([lay.data_spec() for lay in layouts], [P()] * len(layouts)),
        out_specs=[P()] * len(layouts),
        axis_names=set(plan.manual_axes),
        check_vma=False,  # all_gather's result is replicated; vma cannot infer that
    )
    return jax.tree.unflatten(plan.params_def, gather_fn(shards, jax.tree.leaves(old)))


def _gathered(shard: jax.Array, layout, old: jax.Array) -> jax.Array:
    """An updated shard all-gathered. A stack of layers (three or more dimensions, sharded
    along one after the first) is gathered one layer at a time, each written over its
    layer of the old parameter (donated: the update in place). Gathered whole along a
    dimension that is not the leading one, XLA:GPU gathers it in another layout and copies
    it over, the whole leaf held twice (a third of a GPT's parameters for its largest leaf,
    stage 2's peak); stacked by ``lax.map`` instead, jaxlib 0.11.2's XLA held a second
    copy of the whole model (stage 1's temp 94 -> 144 MB for the example GPT)."""
    if not layout.sharded:
        return shard
    if shard.ndim >= 3 and layout.axis(shard) > 0:

        def one(i, out):
            layer = all_gather(jax.lax.dynamic_index_in_dim(shard, i, keepdims=False), layout)
            return jax.lax.dynamic_update_index_in_dim(out, layer.astype(out.dtype), i, 0)

        return jax.lax.fori_loop(0, shard.shape[0], one, old)
    return all_gather(shard, layout)
