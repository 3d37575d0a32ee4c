"""``Checkpointer``: save and resume a ZeRO run with Orbax, restorable at any stage and size.

A checkpoint holds two Orbax items: ``state``, a flat dict of named arrays, and ``meta``,
JSON. The arrays are the run's *weights* (the fp32 master weights under mixed precision,
else the parameters -- the 16-bit parameters are their cast, so nothing is lost), the Optax
state, the step, the loss-scale state and the model state, each in the layout it had at
rest (padded where it was partitioned). ``meta`` records, per array, its true shape, dtype
and a checksum of its true region (:mod:`jzero.core.checksum`), plus the stage, mesh and precision
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
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..core.checksum import checksums
from ..core.optimizer import ZeroOptimizer
from ..core.state import ZeroState
from .format import FORMAT, VERSION, CheckpointError, flatten
from .relayout import assemble_state, restore_targets

logger = logging.getLogger("jzero")


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
        arrays, shapes = flatten(state)
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
                nested dicts (e.g. holds lists) or holds typed PRNG keys (e.g. NNX RNG
                streams: saved as their uint32 data, typed again like these); default:
                rebuilt as nested dicts, keys as their data.

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
        targets = restore_targets(plan, stored, step, model_state, opt.precision.dynamic_loss_scale)
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
        return assemble_state(opt, plan, arrays, targets, model_state), meta.get("extra")


def _first_line(e: BaseException) -> str:
    """The useful head of an Orbax / tensorstore error (they append whole specs)."""
    text = str(e).strip().split(" See full TensorStore details")[0].splitlines()
    return text[0][:300].rstrip(".") if text else ""


def _leaf_hint(message: str, targets: Mapping[str, Any]) -> str:
    found = [k for k in targets if k in message]
    return f"; leaf {max(found, key=len)!r}" if found else ""
