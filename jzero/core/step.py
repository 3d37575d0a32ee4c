"""The training step: forward/backward under ``shard_map``, then the global-view Optax update.

Forward/backward runs in the local view (:mod:`.backward`: the collectives per stage, over
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
from .axis_alias import alias_mesh
from .axis_names import check_aliases
from .backward import local_grads
from .batch_sharding import check_batch_sharding
from .checks import check_batch, check_global_batch, check_live, check_state
from .comm.collectives import all_gather
from .layout import pad, unpad
from .memory import check_state_offload
from .mesh_types import on_compute_mesh, typed
from .offload.host_step import Gradients, host_update
from .offload.options import NO_OFFLOAD, Offload
from .offload.update import offloaded_update
from .placement import constrain, store, to_device, typed_state, view
from .plan import Plan
from .precision import Precision
from .state import ZeroState
from .weighted import CountWatch, Weighted, counted, divisor, skip_uncounted

Metrics = dict[str, Any]


class TrainStep:
    """The jitted ``step(state, batch) -> (state, metrics)``, refusing a consumed state.

    In a run of several processes it first compares, once per new batch layout, the
    configuration every process runs with (:mod:`.agreement`: a mismatch is named on every
    process instead of hanging in the first collective), then refuses a global batch that
    is not split over the mesh's batch axes (:mod:`.batch_sharding`).

    ``lower(state, batch)`` gives the jitted program's lowering (for
    :func:`jzero.report` and ``.compile().memory_analysis()``).
    """

    def __init__(self, jitted: Any, donate: bool, *, mesh: Mesh, agreement: Agreement):
        self._jitted, self._donate = jitted, donate
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
    tx: optax.GradientTransformation,
    precision: Precision,
    loss_fn: Callable[..., Any],
    *,
    mesh: Mesh,
    stage: int,
    offload: Offload = NO_OFFLOAD,
    manual_gather: bool = False,
    grad_accum: int = 1,
    with_model_state: bool = False,
    has_aux: bool = False,
    donate: bool = True,
    per_device_rng: bool = True,
    axis_name: str | tuple[str, ...] | None = None,
    bucket: bool = False,
    prefetch: bool = False,
) -> TrainStep:
    """Builds the jitted ``step(state, batch) -> (state, metrics)`` for ``state.plan``.

    Args:
        tx: the Optax transformation.
        precision: the precision policy (reduce dtype, loss scaling).
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over its batch. It runs
            per device on that device's slice of the batch (leading axis split over 'data').
            With ``has_aux``, it returns ``(loss, aux)``. It may return a
            :class:`jzero.Weighted` ``(total, count)`` in place of the mean: the step then
            sums both over devices and micro-batches and trains on their quotient, the
            global-batch objective whatever the number of tokens on each device.
        mesh, stage, offload: what the state must have been made for (checked at trace
            time, with ``precision`` and ``tx``: a state from another optimizer is refused,
            and so is one whose leaves are not in the memory its plan stores them in).
        manual_gather: if False (default), stage 3 gathers each parameter where the loss
            first uses it, one layer at a time inside scans and checkpointed layers
            (:mod:`jzero.core.gather.autogather`). If True, ``loss_fn`` receives
            :class:`Sharded` handles in stages 2/3 and calls :func:`jzero.gather` on each
            layer's parameters where it uses them, inside a rematerialised layer
            (``jax.checkpoint`` / ``nn.remat``), so stage 3 holds about one layer's gathered
            parameters at a time and backward gathers again. Call ``gather`` once per
            parameter and forward pass: each call is one reduce-scatter of that parameter's
            gradient in backward (stages 2/3).
        grad_accum: split each device's batch into this many micro-batches and accumulate
            their gradients in fp32 inside the step (``lax.scan``). Stages 0/1 keep a
            full-size local accumulator and communicate once per step; stages 2/3 keep only
            their 1/N shard and reduce-scatter every micro-batch (more, smaller messages
            for 1/N of the accumulator memory).
        with_model_state: the loss also reads and updates non-trainable model state
            (``state.model_state``, e.g. Flax ``batch_stats``), replicated over 'data':
            ``loss_fn(params, model_state, batch) -> (loss, new_model_state)`` (with
            ``has_aux``: ``((loss, aux), new_model_state)``). jzero then makes the new state
            agree on every device (mean of floats, max of integers).
        has_aux: ``loss_fn`` returns ``(loss, aux)``, as for ``jax.value_and_grad(...,
            has_aux=True)``; ``metrics['aux']`` holds aux averaged over devices and
            micro-batches (floats; integers are summed, e.g. token counts).
        donate: donate the old state's buffers to the new one.
        per_device_rng: typed PRNG keys in the model state (``jax.random.key``; an NNX
            ``RngStream``'s key) are folded with the device's index along the batch axes
            before ``loss_fn`` sees them, so devices draw independently (e.g. dropout
            masks); the state written back is the same on every device (the unfolded key
            if ``loss_fn`` left it as it got it, else device 0's). False: every device
            gets the same key, as before.
        axis_name: the model's own name(s) for the batch axis, e.g. ``'batch'`` for a
            Flax ``nn.BatchNorm(axis_name='batch')``: collectives over it run over the
            batch axes (``'data'``; ``('replica', 'data')`` when hybrid), so synchronised
            statistics are those of the global batch. A collective over an axis that is
            neither a mesh axis nor an alias raises ``ValueError`` naming it.
        bucket: each layer's leaves travel as one flat all-gather (stage 3) and one flat
            reduce-scatter (stages 2/3) per dtype instead of one collective per leaf
            (DeepSpeed's buckets, FSDP2's parameter groups; :mod:`.comm.buckets`). A layer is
            what one gather happens for: a scan step (stage 3's default), a
            :func:`jzero.remat_layer`, a ``layers=`` block, a ``jzero.gather`` call.
            The collectives are exact (bitwise those of ``bucket=False``).
        prefetch: stage 3's default gathering, in scans over stacked layers: issue layer
            i+1's all-gather in the step that computes layer i, and in backward layer
            i-1's in the step of layer i (FSDP2's forward/backward prefetch, for XLA's
            latency-hiding scheduler on GPU; :mod:`.gather.prefetch`). Two layers are gathered
            at a time instead of one, and backward recomputes each layer's forward from
            its input (activations are not kept). Same values as without.

    ``metrics`` holds ``loss`` (mean over the global batch), ``grad_norm`` (global L2 norm
    of the averaged gradient, padding excluded) and, with dynamic loss scaling,
    ``loss_scale`` and ``skipped`` (1 where non-finite gradients skipped the update); with
    a :class:`Weighted` loss, ``count`` (the global count) and ``skipped`` (1 also where a
    negative or non-finite count skipped the step; see :class:`Weighted`).
    """
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    aliases = check_aliases(axis_name, mesh.axis_names)

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        check_state(state, stage=stage, mesh=mesh, mixed=precision.mixed, tx=tx)
        check_state_offload(state, offload)
        plan = state.plan
        n = plan.dp_size  # R·G: the batch is split over ('replica', 'data') when hybrid
        check_batch(batch, n, grad_accum)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1)
        body = local_grads(
            plan,
            loss_fn,
            manual_gather=manual_gather,
            grad_accum=grad_accum,
            precision=precision,
            has_aux=has_aux,
            with_model_state=with_model_state,
            per_device_rng=per_device_rng,
            aliases=aliases,
            bucket=bucket,
            prefetch=prefetch,
        )
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
        # Global view from here: sums -> means (and unscaled), padding sliced off.
        ok = None  # Weighted: whether the global count is valid (else the step is skipped)
        if isinstance(loss, Weighted):  # global sums: divide by the global count
            ok, count = counted(loss.count), loss.count
            loss, denominator = loss.total / divisor(count), divisor(count) * scale
        else:
            denominator = n * grad_accum * scale
        reduced = grads
        grads = jax.tree.map(
            lambda g, lay: unpad(g.astype(jnp.float32) / denominator, lay),
            grads,
            plan.params_tree(),
        )
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        finite = None
        if state.loss_scale is not None:  # non-finite gradients: the update keeps the state
            finite = jnp.isfinite(metrics["grad_norm"])
        keep = ok if finite is None else (finite if ok is None else finite & ok)
        new_state = _update(tx, precision, state, Gradients(reduced, denominator, grads), keep)
        if has_aux:
            metrics["aux"] = aux
        if finite is not None:
            new_state = new_state.replace(loss_scale=state.loss_scale.next(finite, precision))
            metrics |= {"loss_scale": scale, "skipped": (~finite).astype(jnp.int32)}
        new_state = new_state.replace(step=state.step + 1, model_state=model_state)
        if ok is not None:
            new_state, metrics = skip_uncounted(ok, count, state, new_state, metrics)
        return new_state, metrics

    options = dict(
        offload=offload,
        manual_gather=manual_gather,
        grad_accum=grad_accum,
        with_model_state=with_model_state,
        has_aux=has_aux,
        donate=donate,
        per_device_rng=per_device_rng,
        axis_name=axis_name,
        bucket=bucket,
        prefetch=prefetch,
    )
    agreement = Agreement(stage=stage, mesh=mesh, precision=precision, options=options)
    jitted = jax.jit(_on_mesh(step, mesh), donate_argnums=0 if donate else ())
    return TrainStep(jitted, donate, mesh=mesh, agreement=agreement)


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
    (:func:`.offload.host_step.host_update`). Leaves the plan stores in host memory
    (offloaded parameters and master weights too) are copied in to be updated on the
    device and the new ones written back there (:func:`.placement.constrain`).
    """
    plan = state.plan
    weights = state.master if plan.master is not None else state.params
    if plan.host_step:
        params, opt_state, master = host_update(
            tx, precision, plan, grads, state.opt_state, weights, finite
        )
    else:
        update = offloaded_update if plan.offloads else _device_update
        params, opt_state, master = update(
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
