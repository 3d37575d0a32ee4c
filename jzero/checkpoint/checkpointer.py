"""``Checkpointer``: save and resume a ZeRO run with Orbax, restorable at any stage and size.

A checkpoint holds two Orbax items: ``state``, a flat dict of named arrays, and ``meta``,
JSON. The arrays are the run's *weights* (the fp32 master weights under mixed precision,
else the parameters -- the 16-bit parameters are their cast, so nothing is lost), the Optax
state, the step, the loss-scale state and the model state, each in the layout it had at
rest (padded where it was partitioned). ``meta`` records, per array, its true shape, dtype
and a checksum of its true region (:mod:`.checksum`), plus the stage, mesh and precision
it was written with and the caller's ``extra``.

Restoring lays every array out for the *restoring* optimizer's plan: Orbax reads each
device's region straight from the files (``PyTreeRestore`` with ``strict=False`` truncates or
zero-pads the padded dimension), after jzero has checked that every true shape and dtype
matches, and before it verifies every checksum. So a checkpoint written at stage s on N
devices restores at stage s' on N', in fp32 or 16-bit-with-master precision.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

from ..core.checksum import checksums
from ..core.optimizer import ZeroOptimizer
from ..core.placement import state_shardings, store, view
from ..core.plan import Plan, Stored
from ..core.precision import LossScale
from ..core.state import ZeroState
from .names import leaf_names, unflatten_names

FORMAT, VERSION = "jzero-checkpoint", 1
logger = logging.getLogger("jzero")


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: missing, corrupt, or of another model."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` gives back.

    Attributes:
        state: the :class:`jzero.ZeroState`, laid out for the restoring optimizer.
        step: the checkpoint's step.
        extra: the JSON value saved with it (``save(..., extra=...)``), or None.
        skipped: ``(step, reason)`` for every newer checkpoint found invalid and skipped.
    """

    state: ZeroState
    step: int
    extra: Any
    skipped: tuple[tuple[int, str], ...] = ()


def _key(group: str, name: str) -> str:
    return f"{group}.{name}" if name else group


def _weights_stored(plan: Plan) -> tuple[Stored, ...]:
    """Where the fp32 weights live: the master weights' layout, else the parameters'."""
    return plan.master if plan.master is not None else plan.params


def _flatten(state: ZeroState) -> tuple[dict[str, jax.Array], dict[str, tuple[int, ...]]]:
    """The state as ``{name: stored array}`` and ``{name: true shape}``."""
    plan = state.plan
    weights = state.master if plan.master is not None else state.params
    groups = [
        ("weights", weights, [s.layout.shape for s in _weights_stored(plan)]),
        ("opt_state", state.opt_state, [s.layout.shape for s in plan.opt]),
        ("model_state", state.model_state, None),
        ("loss_scale", state.loss_scale, None),
    ]
    arrays, shapes = {"step": state.step}, {"step": ()}
    for group, tree, true in groups:
        leaves = jax.tree.leaves(tree)
        true = true if true is not None else [tuple(x.shape) for x in leaves]
        for name, x, shape in zip(leaf_names(tree), leaves, true):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                raise TypeError(
                    f"{group} leaf {name!r} is a typed PRNG key; store its data instead "
                    "(jax.random.key_data) and wrap it again after restore."
                )
            arrays[_key(group, name)] = x
            shapes[_key(group, name)] = tuple(int(d) for d in shape)
    return arrays, shapes


def _target(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)


class Checkpointer:
    """Saves and restores :class:`jzero.ZeroState` s in ``directory`` with Orbax.

    Each process writes its own shards; saves are asynchronous by default (``save``
    returns once the arrays are copied off the devices, so the next, donating steps are
    safe). An interrupted save leaves the earlier checkpoints intact.

    Args:
        directory: where the checkpoints go (one sub-directory per step).
        max_to_keep: keep only the newest this many checkpoints (None: all).
        save_every: ``save(step, ...)`` writes only when ``step`` is a multiple of this
            (``force=True`` writes anyway).
        async_save: write in the background (call :meth:`wait` or :meth:`close` before
            reading the files or exiting).

    Examples:
        >>> ckpt = jzero.Checkpointer("runs/ckpt", max_to_keep=3, save_every=100)
        >>> ckpt.save(step, state, extra={"data_position": i})  # doctest: +SKIP
        >>> restored = ckpt.restore(opt, params_shapes)  # newest valid  # doctest: +SKIP
        >>> state, extra = restored.state, restored.extra  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_every: int = 1,
        async_save: bool = True,
    ):
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(
                f"checkpoint directory {directory} is a file; pass a directory path."
            )
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None or an int >= 1, got {max_to_keep!r}.")
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every must be an int >= 1, got {save_every!r}.")
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_every,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(directory, options=options)

    # --------------------------------------------------------------------------- saving
    def save(self, step: int, state: ZeroState, *, extra: Any = None, force: bool = False) -> bool:
        """Saves ``state`` as checkpoint ``step`` (if ``step`` is due, or ``force``).

        Args:
            step: the checkpoint's number, usually ``int(state.step)``; increasing.
            state: the :class:`jzero.ZeroState` to save.
            extra: any JSON-serialisable value saved with it (e.g. the data position).
            force: save even when ``step`` is not a multiple of ``save_every``.

        Returns:
            Whether a save was started.
        """
        if not isinstance(state, ZeroState):
            raise TypeError(f"save() takes a jzero.ZeroState, got {type(state).__name__}.")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}.")
        step = int(step)
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} is not newer than the latest saved step {latest} "
                f"in {self.directory}; save with a larger step, or use another directory."
            )
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"extra must be JSON-serialisable (dicts, lists, str, finite numbers): {e}. "
                "Convert arrays with .tolist() or int(...)."
            ) from None
        if not force and not self._manager.should_save(step):
            return False
        arrays, shapes = _flatten(state)
        sums = checksums(list(arrays.values()), list(shapes.values()))
        plan = state.plan
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "stage": plan.stage,
            "devices": plan.data_size,
            "mesh": {str(k): int(v) for k, v in plan.mesh.shape.items()},
            "mixed_precision": plan.master is not None,
            "param_dtypes": sorted({str(s.dtype) for s in plan.params}),
            "leaves": {
                name: {"shape": list(shapes[name]), "dtype": str(x.dtype), "checksum": c}
                for (name, x), c in zip(arrays.items(), sums)
            },
            "extra": extra,
        }
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta))
        return bool(self._manager.save(step, args=args, force=True))

    def wait(self) -> None:
        """Blocks until the asynchronous saves in flight are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for saves in flight and releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- reading
    def all_steps(self) -> list[int]:
        """The finished checkpoints' steps, oldest first (not yet verified)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (None: none); see :meth:`restore` for
        the newest *valid* one."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint ``step``."""
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 -- Orbax raises many kinds; all mean unreadable
            raise CheckpointError(f"checkpoint step {step}: metadata unreadable ({e}).") from e
        meta = meta["meta"]
        if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is not jzero's.")
        if meta.get("version") != VERSION:
            raise CheckpointError(
                f"checkpoint step {step} has format version {meta.get('version')}; this "
                f"jzero reads version {VERSION}."
            )
        return dict(meta)

    def read(self, step: int, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """Reads the named arrays of checkpoint ``step`` (any subset) into ``targets``'
        shapes and shardings: each device reads its own region, the padded dimension
        truncated or zero-filled (``strict=False``). Checks nothing: see :meth:`restore`."""
        restore_args = {
            name: ocp.ArrayRestoreArgs(
                sharding=t.sharding, global_shape=t.shape, dtype=t.dtype, strict=False
            )
            for name, t in targets.items()
        }
        args = ocp.args.PyTreeRestore(targets, restore_args=restore_args, partial_restore=True)
        return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]

    # ----------------------------------------------------------------------- restoring
    def restore(
        self, opt: ZeroOptimizer, like: Any, *, step: int | None = None, model_state: Any = None
    ) -> Restored:
        """Restores a checkpoint into ``opt``'s layout (any stage, device count, precision).

        Args:
            opt: the optimizer to train on with (its mesh, stage and precision).
            like: the parameters, or their ``jax.ShapeDtypeStruct`` s (e.g.
                ``jax.eval_shape(init_fn)``): the tree the checkpoint must match.
            step: the checkpoint to restore; None: the newest one that is valid, skipping
                (and reporting in ``skipped``, and as a warning on the ``jzero`` logger)
                newer ones that are corrupt or unreadable.
            model_state: the model state's tree (values or shapes) when it is not plain
                nested dicts (e.g. holds lists); default: rebuilt as nested dicts.

        Raises:
            CheckpointError: no checkpoint, or (``step`` given) this one is invalid: the
                message names the step and the leaf.
        """
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}.")
        skipped: list[tuple[int, str]] = []
        for s in steps:
            try:
                state, extra = self._restore_step(opt, like, int(s), model_state)
            except CheckpointError as e:
                if step is not None:
                    raise
                logger.warning("jzero.Checkpointer: skipping step %d: %s", s, e)
                skipped.append((int(s), str(e)))
                continue
            return Restored(state, int(s), extra, tuple(skipped))
        reasons = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise CheckpointError(f"no valid checkpoint in {self.directory}: {reasons}")

    def _restore_step(
        self, opt: ZeroOptimizer, like: Any, step: int, model_state: Any
    ) -> tuple[ZeroState, Any]:
        if step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint step {step} in {self.directory} (steps: {self.all_steps()})."
            )
        meta = self.metadata(step)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        plan = opt.plan(shapes)
        stored = meta["leaves"]
        targets = self._targets(plan, stored, step, model_state, opt.precision.dynamic_loss_scale)
        extra_leaves = set(stored) - set(targets)
        for name in sorted(extra_leaves, key=lambda n: (not n.startswith("weights"), n)):
            if name.split(".")[0] in ("weights", "opt_state"):
                raise CheckpointError(
                    f"checkpoint step {step} has leaf {name!r}, which the restoring model / "
                    "optimizer does not: the parameter tree or the Optax transformation "
                    "differs from the one saved."
                )
        try:
            arrays = self.read(step, {k: t for k, (t, _) in targets.items() if k in stored})
        except Exception as e:  # noqa: BLE001 -- tensorstore/Orbax errors: unreadable data
            raise CheckpointError(
                f"checkpoint step {step}: reading the arrays failed "
                f"({type(e).__name__}: {_first_line(e)})"
                f"{_leaf_hint(str(e), targets)}."
            ) from e
        names = [k for k in targets if k in stored]
        sums = checksums([arrays[k] for k in names], [targets[k][1] for k in names])
        for name, got in zip(names, sums):
            if got != stored[name]["checksum"]:
                raise CheckpointError(
                    f"checkpoint step {step}: leaf {name!r} fails its checksum (stored "
                    f"{stored[name]['checksum']}, read {got}): the data files are corrupt."
                )
        return self._assemble(opt, plan, arrays, targets, model_state), meta.get("extra")

    def _targets(
        self,
        plan: Plan,
        stored: dict[str, Any],
        step: int,
        model_state: Any,
        dynamic_loss_scale: bool,
    ) -> dict[str, tuple[jax.ShapeDtypeStruct, tuple[int, ...]]]:
        """``{name: (restore target, true shape)}`` for the restoring plan, checked
        against what the checkpoint holds."""
        replicated = plan.sharding(P())
        out = {"step": (_target((), jnp.int32, replicated), ())}
        weights = jax.tree.unflatten(plan.params_def, _weights_stored(plan))
        opt = jax.tree.unflatten(plan.opt_def, plan.opt)
        for group, tree in (("weights", weights), ("opt_state", opt)):
            is_stored = lambda x: isinstance(x, Stored)
            for name, s in zip(
                leaf_names(tree, is_leaf=is_stored), jax.tree.leaves(tree, is_leaf=is_stored)
            ):
                key = _key(group, name)
                dtype = (
                    np.dtype(jnp.float32)
                    if group == "weights" and jnp.issubdtype(s.dtype, jnp.floating)
                    else s.dtype
                )
                out[key] = (_target(s.shape, dtype, plan.sharding(s)), s.layout.shape)
        if dynamic_loss_scale and "loss_scale.scale" in stored:
            out["loss_scale.scale"] = (_target((), jnp.float32, replicated), ())
            out["loss_scale.good_steps"] = (_target((), jnp.int32, replicated), ())
        names = [n for n in stored if n.startswith("model_state.") or n == "model_state"]
        if model_state is not None:
            like_names = [_key("model_state", n) for n in leaf_names(model_state)]
            if sorted(like_names) != sorted(names):
                raise CheckpointError(
                    f"checkpoint step {step}: its model state has leaves {sorted(names)}, but "
                    f"model_state= has {sorted(like_names)}."
                )
        for name in names:
            shape = tuple(stored[name]["shape"])
            out[name] = (_target(shape, stored[name]["dtype"], replicated), shape)
        for name, (target, shape) in out.items():
            if name not in stored:
                if name.startswith(("weights", "opt_state")) or name == "step":
                    raise CheckpointError(
                        f"checkpoint step {step} has no leaf {name!r}: the parameter tree or "
                        "the Optax transformation differs from the one saved."
                    )
                continue
            want = (list(shape), str(target.dtype))
            got = (stored[name]["shape"], stored[name]["dtype"])
            if want != got:
                raise CheckpointError(
                    f"checkpoint step {step}: leaf {name!r} is {got[1]}{got[0]} in the "
                    f"checkpoint but {want[1]}{want[0]} in the restoring model; restore into "
                    "the model that was saved (true shapes and dtypes must match)."
                )
        return out

    def _assemble(
        self,
        opt: ZeroOptimizer,
        plan: Plan,
        arrays: dict[str, jax.Array],
        targets: dict[str, Any],
        model_state: Any,
    ) -> ZeroState:
        """The restored arrays -> a :class:`ZeroState` of ``plan`` (params cast from the
        fp32 weights, master weights kept under mixed precision)."""
        precision = opt.precision
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
                jax.tree.structure(model_state), [named[n] for n in leaf_names(model_state)]
            )
        elif "" in named:
            rebuilt = named[""]
        else:
            rebuilt = unflatten_names(named) if named else None

        def build(weights, opt_state, step, loss_scale):
            w = view(weights, _weights_stored(plan))
            return ZeroState(
                step=step,
                params=store(precision.cast(w), plan.params),
                opt_state=opt_state,
                model_state=None,
                master=None if plan.master is None else store(w, plan.master),
                loss_scale=loss_scale,
                plan=plan,
            )

        fn = jax.jit(build, out_shardings=state_shardings(plan, precision))
        state = fn(weights, opt_state, arrays["step"], loss_scale)
        return state.replace(model_state=rebuilt)


def _first_line(e: BaseException) -> str:
    """The useful head of an Orbax / tensorstore error (they append whole specs)."""
    text = str(e).strip().split(" See full TensorStore details")[0].splitlines()
    return text[0][:300].rstrip(".") if text else ""


def _leaf_hint(message: str, targets: Mapping[str, Any]) -> str:
    found = [k for k in targets if k in message]
    return f"; leaf {max(found, key=len)!r}" if found else ""


def nbytes(state: ZeroState) -> int:
    """Bytes a checkpoint of ``state`` stores (true shapes: no padding)."""
    arrays, shapes = _flatten(state)
    return sum(math.prod(shapes[k]) * np.dtype(x.dtype).itemsize for k, x in arrays.items())
