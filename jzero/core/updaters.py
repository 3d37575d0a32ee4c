"""The optimizer step's three strategies, behind one protocol: :class:`Updater`.

- ``device``: the Optax update on the sharded arrays in device memory (:func:`device_update`).
- ``stream``: the Optax state and fp32 master weights rest in host memory and stream through
  the device, one piece at a time (:func:`.offload.update.offloaded_update`); stage 3's
  offloaded parameters stream the same way when the optimizer stays on the device.
- ``host``: the update runs on the host (:func:`.offload.host_step.host_update`).

:func:`make_updater` picks one from the configuration when the step is built; the step
calls it once per step. Each returns the new parameters (true shapes, on the device; at
stages 1-2 a mixing leaf's along its owner axis, :attr:`Plan.update_layouts`, which the
all-gather starts from; at stage 3 where they rest), the stored Optax state and the stored
master weights (None without).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import optax

from .grad_reduction import Gradients
from .leaf_layout import LeafLayout
from .offload.host_step import host_update
from .offload.update import offloaded_update
from .options.precision import Precision
from .options.zero_config import ZeroConfig
from .plan import Plan, Stored
from .stacked_update import stacked
from .stored_form import constrain, store, to_device, view
from .update_inputs import UpdateInputs, keep_if_finite
from .update_layout import relaid_tree


class UpdateFn(Protocol):
    """What each strategy runs: one step's Optax update (:class:`UpdateInputs`)."""

    def __call__(self, step: UpdateInputs) -> tuple[Any, Any, Any]: ...


@dataclasses.dataclass(frozen=True)
class Updater:
    """One optimizer-step strategy bound to its Optax transformation and precision.

    ``updater(plan, grads, opt_state, weights, finite) -> (params, opt_state, master)``.
    """

    name: str  # "device", "stream" or "host"
    run: UpdateFn
    tx: optax.GradientTransformation
    precision: Precision

    def __call__(self, plan: Plan, grads: Gradients, opt_state: Any, weights: Any, finite):
        return self.run(
            UpdateInputs(self.tx, self.precision, plan, grads, opt_state, weights, finite)
        )

    def before(self, metric: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(metric, opt_state)``, the metric computed before the update reads the state.
        Streamed, it is tied to the stored state: left unordered, XLA may run the gradient
        norm after the last piece, holding every gradient leaf whole on the device through
        the update. (Tying the gradients instead changes XLA:CPU's rounding.)"""
        if self.name != "stream":
            return metric, opt_state
        return jax.lax.optimization_barrier((metric, opt_state))


def make_updater(tx: optax.GradientTransformation, config: ZeroConfig) -> Updater:
    """The updater ``config`` asks for: on the host, streamed through the device (an
    offloaded optimizer, or stage 3's offloaded parameters: never every weight on the
    device at once), or on the device."""
    offload, precision = config.offload, config.precision
    if offload.optimizer == "host":
        return Updater("host", host_update, tx, precision)
    if offload.optimizer == "stream" or offload.params:
        return Updater("stream", offloaded_update, tx, precision)
    return Updater("device", device_update, tx, precision)


def _held(s: Stored) -> LeafLayout:
    """The layout a stored leaf is held in on the device: its own where partitioned, else
    whole (replicated over ``data``)."""
    lay = s.layout
    return (
        lay
        if s.partitioned
        else LeafLayout(lay.shape, None, lay.shape, lay.user_spec, lay.user_spec)
    )


def onto_owners(plan: Plan, tree: Any, stored: tuple[Stored, ...]) -> Any:
    """``tree`` (true shapes, held as ``stored`` says) in the layouts the update runs in
    (:attr:`Plan.update_layouts`): a mixing leaf's along its owner axis, by one all-to-all
    from its shards or a local slice of a whole one; every other leaf as it is."""
    if not any(plan.owner_layouts):
        return tree
    src = [_held(s) if o else s.layout for s, o in zip(stored, plan.owner_layouts)]
    return relaid_tree(tree, src, plan.update_layouts, plan.compute_mesh, plan.manual_axes)


def off_owners(plan: Plan, tree: Any) -> Any:
    """Stage 3's updates or updated parameters (true shapes, in
    :attr:`Plan.update_layouts`) in their stored layouts: one all-to-all per mixing leaf
    with an owner layout. Without master weights the updates go there and are applied to
    the parameters where they rest (the parameters never move to the owner layout unless
    the update reads them: its peak at stage 3 is then AdamW's)."""
    if not any(plan.owner_layouts):
        return tree
    dst = [s.layout for s in plan.params]
    return relaid_tree(tree, plan.update_layouts, dst, plan.compute_mesh, plan.manual_axes)


def device_update(step: UpdateInputs) -> tuple[Any, Any, Any]:
    """The Optax update with the state on the device (:class:`UpdateFn`)."""
    tx, precision, plan, grads, opt_state, weights, finite = step
    stored = plan.master if plan.master is not None else plan.params
    old = view(to_device(plan, weights, stored), stored)
    old_state = view(opt_state, plan.opt)
    averaged = onto_owners(plan, grads.averaged, plan.opt_like)
    held = onto_owners(plan, old, stored)  # moved only where the update reads it
    updates, opt_state = stacked(plan, tx)(averaged, old_state, held)
    resting = plan.master is None and plan.config.partitions_params
    if resting:  # stage 3's parameters: the updates go to where they rest
        updates, held = off_owners(plan, updates), old
    master = optax.apply_updates(held, updates)
    master = keep_if_finite(finite, master, held)  # the old values where the step is skipped
    opt_state = keep_if_finite(finite, opt_state, old_state)
    opt_state = constrain(plan, store(opt_state, plan.opt), plan.opt)
    params = precision.cast(master)
    if plan.master is None:
        return params, opt_state, None
    if plan.config.partitions_params:  # stage 3: from the masters' owner layout
        params = off_owners(plan, params)
    return params, opt_state, constrain(plan, store(master, plan.master), plan.master)
