"""One checkpoint step restored, top to bottom.

:func:`restore_step` reads the step's metadata (its own checksum checked: damage is
corruption), builds what the restoring plan reads (each array's target shape, dtype and
sharding, and its true shape), checks the checkpoint holds that (else a
:class:`CheckpointMismatchError`, decided before any array is read), reads the arrays,
verifies each against its checksum, and assembles the :class:`ZeroState`. A step that is
missing, unreadable, damaged or corrupt raises a plain :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ..core.checksum import checksums
from ..core.options.precision import LossScale, Precision
from ..core.plan import Pending, Plan, Stored, ZeroState, is_key
from ..core.stored_form import restored_state
from .errors import CheckpointError, storage_error_line
from .format import FORMAT, VERSION, meta_damage
from .match import check_match, model_state_names
from .names import leaf_names, unflatten_names

Targets = dict[str, tuple[jax.ShapeDtypeStruct, tuple[int, ...]]]  # name: (target, true shape)


def restore_step(
    manager: ocp.CheckpointManager,
    where: str,
    layout: ZeroState,
    precision: Precision,
    step: int,
    model_state: Any,
) -> tuple[ZeroState, Any]:
    """Checkpoint ``step`` (of the directory ``where`` names) laid out as ``layout`` (the
    restoring optimizer's ``state_shardings``, its plan in ``layout.plan``): the
    state and the ``extra`` saved with it."""
    plan = layout.plan
    meta = read_meta(manager, where, step)
    targets = restore_targets(layout, precision, meta["leaves"])
    check_match(f"checkpoint step {step} in {where}", meta, targets, plan.opt_def, model_state)
    arrays = read_arrays(manager, step, {k: t for k, (t, _) in targets.items()})
    arrays = {k: arrays[k] for k in targets}  # in the targets' order, which groups read
    groups, model_state = _groups(plan, precision, arrays), _model_state(arrays, model_state)
    _verify(step, arrays, targets, meta["leaves"])
    state = restored_state(plan, precision, *groups)
    return state.replace(model_state=model_state), meta.get("extra")


def read_meta(manager: ocp.CheckpointManager, where: str, step: int) -> dict[str, Any]:
    """Step ``step``'s JSON metadata, refused when unreadable, not jzero's, of another
    format version, or damaged (:func:`.format.meta_damage`)."""
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 -- Orbax raises many kinds; all mean unreadable
        raise CheckpointError(f"checkpoint step {step}: metadata unreadable ({e}).") from e
    meta = meta["meta"]
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint step {step} in {where} is not jzero's.")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint step {step} has format version {meta.get('version')}; this "
            f"jzero reads version {VERSION}."
        )
    if (damage := meta_damage(dict(meta))) is not None:
        raise CheckpointError(f"checkpoint step {step} in {where}: {damage}.")
    return dict(meta)


def restore_targets(shardings: ZeroState, precision: Precision, stored: dict[str, Any]) -> Targets:
    """What a plan (laid out as ``shardings``, :func:`state_shardings`) reads of a
    checkpoint whose leaves are ``stored`` (the metadata's): the step, the fp32 weights and
    the Optax state as the plan lays them out, the loss scale and a delayed step's held
    gradient where both sides keep one, and the model state as the checkpoint holds it
    (replicated)."""
    plan = shardings.plan
    weights = plan.master if plan.master is not None else plan.params
    groups: dict[str, Any] = {
        "weights": jax.tree.unflatten(plan.params_def, [_fp32(s) for s in weights]),
        "opt_state": jax.tree.unflatten(plan.opt_def, plan.opt),
    }
    w_sharding = shardings.master if plan.master is not None else shardings.params
    sharding = {"weights": w_sharding, "opt_state": shardings.opt_state}
    if _held(plan, stored):
        groups["pending"] = {"grads": jax.tree.unflatten(plan.params_def, plan.pending)}
        sharding["pending"] = {"grads": shardings.pending.grads}
    is_stored = lambda x: isinstance(x, Stored)
    leaves = jax.tree.leaves(groups, is_leaf=is_stored)
    places = jax.tree.leaves(sharding)
    out: Targets = {}
    for name, s, where in zip(leaf_names(groups, is_leaf=is_stored), leaves, places):
        if is_key(s):  # saved as its raw data (format.flatten), typed again by _groups
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(s.shape, s.dtype))
            out[name] = (jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=where), data.shape)
        else:
            out[name] = (jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), s.layout.shape)
    return out | _scalars(plan, precision, stored, shardings.step)


def _fp32(s: Stored) -> Stored:
    """The weights as a checkpoint holds them: fp32 where floating."""
    floating = jnp.issubdtype(s.dtype, jnp.floating)
    return Stored(s.layout, s.partitioned, np.dtype(np.float32) if floating else s.dtype)


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


def _scalars(plan: Plan, precision: Precision, stored: dict[str, Any], replicated) -> Targets:
    """The replicated leaves: the step, the loss scale, the held gradient's divisor and
    flag, and the model state (its shapes and dtypes as the checkpoint holds them)."""
    want = {"step": ((), jnp.int32)}
    if precision.dynamic_loss_scale and "loss_scale.scale" in stored:
        want |= {"loss_scale.scale": ((), jnp.float32), "loss_scale.good_steps": ((), jnp.int32)}
    if plan.pending is not None and "pending.apply" in stored:
        want |= {"pending.denominator": ((), jnp.float32), "pending.apply": ((), jnp.bool_)}
    for name in model_state_names(stored):
        want[name] = (tuple(stored[name]["shape"]), stored[name]["dtype"])
    target = lambda shape, dtype: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=replicated)
    return {name: (target(shape, dtype), shape) for name, (shape, dtype) in want.items()}


def read_arrays(
    manager: ocp.CheckpointManager, step: int, targets: dict[str, jax.ShapeDtypeStruct]
) -> dict[str, jax.Array]:
    """The named arrays of step ``step`` (any subset) read into ``targets``' shapes and
    shardings: each device reads its own region, the padded dimension truncated or
    zero-filled (``strict=False``). Checks nothing."""
    restore_args = {
        name: ocp.ArrayRestoreArgs(
            sharding=t.sharding, global_shape=t.shape, dtype=t.dtype, strict=False
        )
        for name, t in targets.items()
    }
    args = ocp.args.PyTreeRestore(targets, restore_args=restore_args, partial_restore=True)
    try:
        return manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    except Exception as e:  # noqa: BLE001 -- tensorstore/Orbax errors: unreadable data
        raise CheckpointError(
            f"checkpoint step {step}: reading the arrays failed "
            f"({type(e).__name__}: {storage_error_line(e)}){_leaf_hint(str(e), targets)}."
        ) from e


def _verify(step: int, arrays: dict, targets: Targets, stored: dict[str, Any]) -> None:
    """Every array's checksum over its true region against the one saved with it."""
    names = list(targets)
    sums = checksums([arrays[k] for k in names], [targets[k][1] for k in names])
    for name, got in zip(names, sums):
        if got != stored[name]["checksum"]:
            raise CheckpointError(
                f"checkpoint step {step}: leaf {name!r} fails its checksum (stored "
                f"{stored[name]['checksum']}, read {got}): the data files are corrupt."
            )


def _groups(plan: Plan, precision: Precision, arrays: dict[str, jax.Array]) -> tuple:
    """The read arrays as ``restored_state`` takes them: the weights, the Optax state,
    the step, the loss scale (fresh when the checkpoint has none) and the held gradient
    (None when it has none)."""
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
        is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        leaves = [
            jax.random.wrap_key_data(named[n], impl=x.dtype) if is_key(x) else named[n]
            for n, x in zip(leaf_names(like), jax.tree.leaves(like))
        ]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)
    if "" in named:
        return named[""]
    return unflatten_names(named) if named else None


def _leaf_hint(message: str, targets: Mapping[str, Any]) -> str:
    found = [k for k in targets if k in message]
    return f"; leaf {max(found, key=len)!r}" if found else ""
