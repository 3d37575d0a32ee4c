"""Laying a checkpoint out for a restoring plan: targets checked against the metadata,
then one jitted program that assembles the :class:`ZeroState`."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..core.axis_types import on_compute_mesh
from ..core.options.precision import LossScale, Precision
from ..core.plan import Pending, Plan, Stored, ZeroState
from ..core.stored_form import no_pending, state_shardings, store, view
from .format import array_target, leaf_key, weights_stored
from .names import leaf_names, unflatten_names


def restore_targets(
    plan: Plan, stored: dict[str, Any], dynamic_loss_scale: bool
) -> dict[str, tuple[jax.ShapeDtypeStruct, tuple[int, ...]]]:
    """``{name: (restore target, true shape)}`` for the restoring plan: the step, the
    weights and the Optax state as ``plan`` lays them out, the loss scale when both sides
    keep one, and the model state as the checkpoint holds it (replicated). Compare them
    with the checkpoint with :func:`jzero.checkpoint.match.check_match` before reading."""
    replicated = plan.sharding(P())
    out = {"step": (array_target((), jnp.int32, replicated), ())}
    weights = jax.tree.unflatten(plan.params_def, weights_stored(plan))
    opt = jax.tree.unflatten(plan.opt_def, plan.opt)
    for group, tree in (("weights", weights), ("opt_state", opt)):
        is_stored = lambda x: isinstance(x, Stored)
        for name, s in zip(
            leaf_names(tree, is_leaf=is_stored), jax.tree.leaves(tree, is_leaf=is_stored)
        ):
            key = leaf_key(group, name)
            dtype = (
                np.dtype(jnp.float32)
                if group == "weights" and jnp.issubdtype(s.dtype, jnp.floating)
                else s.dtype
            )
            out[key] = (array_target(s.shape, dtype, plan.sharding(s)), s.layout.shape)
    if dynamic_loss_scale and "loss_scale.scale" in stored:
        out["loss_scale.scale"] = (array_target((), jnp.float32, replicated), ())
        out["loss_scale.good_steps"] = (array_target((), jnp.int32, replicated), ())
    out |= _pending_targets(plan, stored)
    for name in model_state_names(stored):
        shape = tuple(stored[name]["shape"])
        out[name] = (array_target(shape, stored[name]["dtype"], replicated), shape)
    return out


def _pending_targets(plan: Plan, stored: dict[str, Any]) -> dict[str, Any]:
    """The held gradient of a delayed run (``Offload(delay=1)``), where both sides keep one.
    Restored without a delay, it is left out, and so is the one step's gradient it holds
    (warned); a checkpoint without one starts the delay afresh."""
    if "pending.apply" not in stored:
        return {}
    if plan.pending is None:
        warnings.warn(
            "the checkpoint holds the gradient a delayed step had taken (Offload(delay=1)) "
            "for the next step to apply; the restoring optimizer has no delay, so that one "
            "step's gradient is not applied.",
            stacklevel=4,
        )
        return {}
    replicated = plan.sharding(P())
    grads = jax.tree.unflatten(plan.params_def, plan.pending)
    names = leaf_names(grads, is_leaf=lambda x: isinstance(x, Stored))
    out = {
        f"pending.grads.{n}": (array_target(s.shape, s.dtype, plan.sharding(s)), s.layout.shape)
        for n, s in zip(names, plan.pending)
    }
    out["pending.denominator"] = (array_target((), jnp.float32, replicated), ())
    out["pending.apply"] = (array_target((), jnp.bool_, replicated), ())
    return out


def model_state_names(stored: dict[str, Any]) -> list[str]:
    return [n for n in stored if n.startswith("model_state.") or n == "model_state"]


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assemble_state(
    plan: Plan,
    precision: Precision,
    arrays: dict[str, jax.Array],
    targets: dict[str, Any],
    model_state: Any,
) -> ZeroState:
    """The restored arrays -> a :class:`ZeroState` of ``plan`` (params cast from the
    fp32 weights, master weights kept under mixed precision)."""
    group = lambda g: [arrays[k] for k in targets if k.split(".")[0] == g and k in arrays]
    weights = jax.tree.unflatten(plan.params_def, group("weights"))
    opt_state = jax.tree.unflatten(plan.opt_def, group("opt_state"))
    loss_scale = None
    if precision.dynamic_loss_scale:
        if "loss_scale.scale" in arrays:
            loss_scale = LossScale(arrays["loss_scale.scale"], arrays["loss_scale.good_steps"])
        else:
            loss_scale = LossScale.create(precision)
    named = {
        k.removeprefix("model_state").removeprefix("."): arrays[k]
        for k in targets
        if k.startswith("model_state") and k in arrays
    }
    if model_state is not None:
        rebuilt = jax.tree.unflatten(
            jax.tree.structure(model_state),
            [  # PRNG keys were saved as their data: typed again like model_state's keys
                jax.random.wrap_key_data(named[n], impl=like.dtype) if _is_key(like) else named[n]
                for n, like in zip(leaf_names(model_state), jax.tree.leaves(model_state))
            ],
        )
    elif "" in named:
        rebuilt = named[""]
    else:
        rebuilt = unflatten_names(named) if named else None

    pending = None
    if plan.pending is not None and "pending.apply" in arrays:
        held = [arrays[k] for k in targets if k.startswith("pending.grads.")]
        grads = jax.tree.unflatten(plan.params_def, held)
        pending = Pending(grads, arrays["pending.denominator"], arrays["pending.apply"])

    def build(weights, opt_state, step, loss_scale, pending):
        w = view(weights, weights_stored(plan))
        return ZeroState(
            step=step,
            params=store(precision.cast(w), plan.params),
            opt_state=opt_state,
            model_state=None,
            master=None if plan.master is None else store(w, plan.master),
            loss_scale=loss_scale,
            plan=plan,
            pending=no_pending(plan) if pending is None else pending,
        )

    fn = jax.jit(on_compute_mesh(build, plan.mesh), out_shardings=state_shardings(plan, precision))
    state = fn(weights, opt_state, arrays["step"], loss_scale, pending)
    return state.replace(model_state=rebuilt)
