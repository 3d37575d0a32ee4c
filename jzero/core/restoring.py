"""A :class:`ZeroState` rebuilt from named arrays, at any stage, device count and precision.

A checkpoint holds the step, the fp32 weights, the Optax state, the loss scale, a delayed
step's held gradient and the model state, each leaf under its :func:`.leaf_names` name and
with its true shape. :func:`read_targets` says what a plan reads of it: each array's name,
its shape, dtype and sharding as the plan lays it out, and its true shape.
:func:`assemble` builds the state from what was read, in one jitted program.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .axis_types import on_compute_mesh
from .leaf_names import leaf_names, unflatten_names
from .options.precision import LossScale, Precision
from .plan import Pending, Plan, Stored, ZeroState, is_key
from .stored_form import no_pending, store, view

Targets = dict[str, tuple[jax.ShapeDtypeStruct, tuple[int, ...]]]  # name: (target, true shape)


def read_targets(plan: Plan, precision: Precision, stored: dict[str, Any]) -> Targets:
    """What ``plan`` reads of a checkpoint whose leaves are ``stored`` (its metadata's):
    the step, the fp32 weights and the Optax state as the plan lays them out, the loss scale
    and a delayed step's held gradient where both sides keep one, and the model state as
    the checkpoint holds it (replicated)."""
    held = _held(plan, stored)
    scalars = _scalars(precision, stored, held)
    weights = plan.master if plan.master is not None else plan.params
    groups: dict[str, Any] = {
        "weights": jax.tree.unflatten(plan.params_def, [_fp32(s) for s in weights]),
        "opt_state": jax.tree.unflatten(plan.opt_def, plan.opt),
    }
    if held:
        groups["pending"] = {"grads": jax.tree.unflatten(plan.params_def, plan.pending)}
    is_stored = lambda x: isinstance(x, Stored)
    out: Targets = {}
    for name, s in zip(
        leaf_names(groups, is_leaf=is_stored), jax.tree.leaves(groups, is_leaf=is_stored)
    ):
        where = plan.sharding(s)
        if is_key(s):  # saved as its raw data, typed again by _groups
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(s.shape, s.dtype))
            out[name] = (jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=where), data.shape)
        else:
            out[name] = (jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), s.layout.shape)
    replicated = plan.sharding(P())
    for name, (shape, dtype) in scalars.items():
        out[name] = (jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=replicated), shape)
    return out


def _fp32(s: Stored) -> Stored:
    """The weights as a checkpoint holds them: fp32 where floating."""
    if not jnp.issubdtype(s.dtype, jnp.floating):
        return s
    return dataclasses.replace(s, dtype=np.dtype(np.float32))


def _held(plan: Plan, stored: dict[str, Any]) -> bool:
    """Whether both sides keep a delayed step's held gradient. One saved by a delayed run
    and restored without a delay is left out, and so is the one step's gradient it holds
    (warned); a checkpoint without one restored with a delay starts the delay afresh."""
    if "pending.apply" not in stored:
        return False
    if plan.pending is None:
        warnings.warn(
            "the checkpoint holds the gradient a delayed step had taken (Offload(delay=1)) "
            "for the next step to apply; the restoring optimizer has no delay, so that one "
            "step's gradient is not applied.",
            stacklevel=5,
        )
    return plan.pending is not None


def _scalars(precision: Precision, stored: dict[str, Any], held: bool) -> dict[str, tuple]:
    """The replicated leaves' shapes and dtypes: the step, the loss scale, the held
    gradient's divisor and flag (``held``: both sides keep one, :func:`_held`), and the
    model state (as the checkpoint holds it)."""
    want = {"step": ((), jnp.int32)}
    if precision.dynamic_loss_scale and "loss_scale.scale" in stored:
        want |= {"loss_scale.scale": ((), jnp.float32), "loss_scale.good_steps": ((), jnp.int32)}
    if held:
        want |= {"pending.denominator": ((), jnp.float32), "pending.apply": ((), jnp.bool_)}
    for name in model_state_names(stored):
        want[name] = (tuple(stored[name]["shape"]), stored[name]["dtype"])
    return want


def model_state_names(stored: dict[str, Any]) -> list[str]:
    """The model state's leaves among a checkpoint's ``stored`` names."""
    return [n for n in stored if n.startswith("model_state.") or n == "model_state"]


def assemble(
    plan: Plan, precision: Precision, arrays: dict[str, jax.Array], like: Any
) -> ZeroState:
    """The :class:`ZeroState` of ``plan`` from the arrays read into :func:`read_targets`
    (by name, in its order), in one jitted program: the parameters cast from the stored fp32
    weights (kept as the master weights under mixed precision), a fresh loss scale and held
    gradient where the checkpoint has none, and the model state shaped like ``like`` (see
    :func:`_model_state`)."""
    model_state = _model_state(arrays, like)
    groups = _groups(plan, precision, arrays)

    def build(weights, opt_state, step, loss_scale, pending):
        params = precision.cast(weights)  # elementwise: the same before or after the view
        stored = plan.master if plan.master is not None else plan.params
        return ZeroState(
            step=step,
            params=store(view(params, stored), plan.params),
            opt_state=opt_state,
            model_state=None,
            master=None if plan.master is None else store(view(weights, stored), plan.master),
            loss_scale=loss_scale,
            plan=plan,
            pending=no_pending(plan) if pending is None else pending,
        )

    out = plan.state_shardings(precision)
    state = jax.jit(on_compute_mesh(build, plan.mesh), out_shardings=out)(*groups)
    return state.replace(model_state=model_state)


def _groups(plan: Plan, precision: Precision, arrays: dict[str, jax.Array]) -> tuple:
    """The read arrays as the program takes them: the weights, the Optax state, the step,
    the loss scale (fresh when the checkpoint has none) and the held gradient (None when
    it has none)."""
    group = lambda g: [x for k, x in arrays.items() if k.split(".")[0] == g]
    weights = jax.tree.unflatten(plan.params_def, group("weights"))
    typed = lambda x, s: jax.random.wrap_key_data(x, impl=s.dtype) if is_key(s) else x
    opt_state = jax.tree.unflatten(plan.opt_def, list(map(typed, group("opt_state"), plan.opt)))
    loss_scale = None
    if precision.dynamic_loss_scale:
        loss_scale = LossScale.create(precision)
        if "loss_scale.scale" in arrays:
            loss_scale = LossScale(arrays["loss_scale.scale"], arrays["loss_scale.good_steps"])
    pending = None
    if "pending.apply" in arrays:
        held = [x for k, x in arrays.items() if k.startswith("pending.grads.")]
        grads = jax.tree.unflatten(plan.params_def, held)
        pending = Pending(grads, arrays["pending.denominator"], arrays["pending.apply"])
    return weights, opt_state, arrays["step"], loss_scale, pending


def _model_state(arrays: dict[str, jax.Array], like: Any) -> Any:
    """The model state read back: shaped like ``like`` (its PRNG keys typed again, as
    they were saved as their data), else nested dicts (a lone leaf as itself)."""
    named = {
        k.removeprefix("model_state").removeprefix("."): x
        for k, x in arrays.items()
        if k.startswith("model_state")
    }
    if like is not None:
        leaves = [
            jax.random.wrap_key_data(named[n], impl=x.dtype) if is_key(x) else named[n]
            for n, x in zip(leaf_names(like), jax.tree.leaves(like))
        ]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)
    if "" in named:
        return named[""]
    return unflatten_names(named) if named else None
