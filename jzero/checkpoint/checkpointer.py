"""``Checkpointer``: save and resume a ZeRO run with Orbax, restorable at any stage and size.

A checkpoint holds two Orbax items: ``state``, a flat dict of named arrays, and ``meta``,
JSON. The arrays are the run's *weights* (the fp32 master weights under mixed precision,
else the parameters -- the 16-bit parameters are their cast, so nothing is lost), the Optax
state, the step, the loss-scale state and the model state, each in the layout it had at
rest (padded where it was partitioned). ``meta`` records, per array, its true shape, dtype
and a checksum of its true region (:mod:`jzero.core.checksum`), plus the stage, mesh,
precision and Optax state types it was written with, the caller's ``extra``, and a checksum
of itself: damaged metadata makes a corrupt checkpoint, never a "mismatch".

Restoring lays every array out for the *restoring* optimizer's plan: Orbax reads each
device's region straight from the files (``PyTreeRestore`` with ``strict=False`` truncates or
zero-pads the padded dimension), after jzero has checked that every true shape and dtype
matches, and before it verifies every checksum. So a checkpoint written at stage s on N
devices restores at stage s' on N', in fp32 or 16-bit-with-master precision. A checkpoint
that holds another model or optimizer than the restoring one is reported as that
(:class:`CheckpointMismatchError`, from the metadata alone), never as a corrupt one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..core.checksum import checksums
from ..core.gpu_target.compile_only import check_runnable
from ..core.input_checks import check_live
from ..core.plan import ZeroState
from ..optimizers.zero_optimizer import ZeroOptimizer
from .argument_checks import check_extra, check_like, check_optimizer
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    storage_error_line,
)
from .format import (
    META_CHECKSUM,
    build_meta,
    flatten,
    meta_checksum,
)
from .reading import read_arrays, read_meta
from .restore import restore_step

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
    safe). An interrupted or failed save leaves the earlier checkpoints intact.

    Nothing is lost or overwritten silently:

    - A step that exists on disk is never overwritten, whoever wrote it (another
      ``Checkpointer`` on the same directory, another process, an earlier run): ``save``
      re-reads the directory's steps before each write and refuses an existing or older
      step unless ``overwrite=True`` (which replaces that one step).
    - A save that fails in the background (disk full, permissions, a vanished
      directory) raises :class:`jzero.checkpoint.CheckpointSaveError`, naming the step
      and the cause, from the next call that can report it: ``save`` (one that writes;
      in a single-process run any ``save``), :meth:`wait` or :meth:`close`. ``close``
      releases Orbax's resources first, so the process can exit.
    - Reading never creates the directory; a missing one raises
      :class:`jzero.checkpoint.CheckpointNotFoundError` (a ``FileNotFoundError``).

    Args:
        directory: where the checkpoints go (one sub-directory per step); created by the
            first save.
        max_to_keep: keep only the newest this many checkpoints (None: all).
        save_every: ``save(step, ...)`` writes only when ``step`` is a multiple of this,
            or when JAX's preemption sync point is reached (``force=True`` writes anyway).
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
        self.save_every = save_every
        # Directories are made in save() itself: when Orbax makes them in the background
        # and that fails, its other threads wait ~300 s for them and hold the process.
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self._manager: ocp.CheckpointManager | None = None  # made on first use
        self._in_flight: int | None = None  # the step of a save not yet known to be on disk
        self._closed = False

    def _open(self, *, create: bool) -> ocp.CheckpointManager | None:
        """Orbax's manager; None when the directory does not exist and ``create`` is
        False (reading never creates it)."""
        if self._closed:
            raise RuntimeError(
                f"this Checkpointer of {self.directory} was closed (close() or the end of "
                "its with-block); create a new jzero.Checkpointer(directory) to use it again."
            )
        if self._manager is None:
            if not create and not os.path.isdir(self.directory):
                return None
            self._manager = ocp.CheckpointManager(self.directory, options=self._options)
        return self._manager

    def _existing(self) -> ocp.CheckpointManager:
        manager = self._open(create=False)
        if manager is None:
            raise CheckpointNotFoundError(
                f"checkpoint directory {self.directory} does not exist (nothing was "
                "created); pass the directory the run saved to."
            )
        return manager

    # --------------------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        state: ZeroState,
        *,
        extra: Any = None,
        force: bool = False,
        overwrite: bool = False,
    ) -> bool:
        """Saves ``state`` as checkpoint ``step`` (if ``step`` is due, or ``force``).

        Args:
            step: the checkpoint's number, usually ``int(state.step)``; newer than every
                checkpoint in the directory.
            state: the :class:`jzero.ZeroState` to save (the one the last step returned:
                a state donated to a step is refused before any buffer is read).
            extra: JSON saved with it (e.g. the data position) and given back exactly:
                dicts with str keys, lists, str, bool, None, ints and finite floats.
            force: save even when ``step`` is not a multiple of ``save_every``.
            overwrite: replace checkpoint ``step`` if it exists (deleted first);
                without it an existing step is refused.

        Returns:
            Whether a save was started.

        Raises:
            CheckpointSaveError: the previous asynchronous save failed (this one was not
                started), or this one could not start.
            ValueError: ``step`` exists (without ``overwrite``) or is older than the newest
                checkpoint; ``state`` was donated.
        """
        if not isinstance(state, ZeroState):
            raise TypeError(f"save() takes a jzero.ZeroState, got {type(state).__name__}.")
        check_runnable(state.plan.mesh, "jzero.Checkpointer.save")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}.")
        step = int(step)
        check_live(state)  # before any buffer is read: a donated one can crash the process
        check_extra(extra)
        manager = self._open(create=True)
        due = force or step % self.save_every == 0 or manager.reached_preemption(step)
        self._report_failed_save(block=due)
        if not due:
            return False
        self._check_free(manager, step, overwrite=overwrite)
        arrays, shapes = flatten(state)
        sums = checksums(list(arrays.values()), list(shapes.values()))
        meta = build_meta(state, step, shapes, arrays, sums) | {"extra": extra}
        meta[META_CHECKSUM] = meta_checksum(meta)  # damage to the metadata is corruption too
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta))
        try:
            started = manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 -- Orbax/tensorstore/OS errors: not saved
            raise CheckpointSaveError(self._not_saved(step, e)) from e
        self._in_flight = step if started else None
        return bool(started)

    def _check_free(self, manager: ocp.CheckpointManager, step: int, *, overwrite: bool) -> None:
        """``step`` may be written: re-read from disk, since other writers may share the
        directory."""
        steps = self.all_steps()
        newest = f"the newest is {steps[-1]}" if steps else ""
        if step in steps and overwrite:
            manager.delete(step)
        elif step in steps:
            raise ValueError(
                f"checkpoint step {step} already exists in {self.directory} (written by this "
                f"or another Checkpointer; {newest}); save a newer step, or pass "
                "overwrite=True to replace it."
            )
        elif steps and step < steps[-1]:
            raise ValueError(
                f"checkpoint step {step} is older than the newest checkpoint in "
                f"{self.directory} ({newest}, written by this or another Checkpointer); save "
                "a newer step, delete the newer checkpoints, or use another directory."
            )

    def _report_failed_save(self, *, block: bool) -> None:
        """Raises :class:`CheckpointSaveError` if the save in flight failed. Without
        ``block``, only if it has finished (and only in a single-process run, where no
        other process has to raise at the same call)."""
        step, manager = self._in_flight, self._manager
        if step is None or manager is None:
            return
        if not block and (jax.process_count() > 1 or manager.is_saving_in_progress()):
            return
        self._in_flight = None
        try:
            manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 -- whatever stopped the background write
            raise CheckpointSaveError(self._not_saved(step, e)) from e
        manager.reload()
        if step not in manager.all_steps():
            raise CheckpointSaveError(
                f"checkpoint step {step} is not in {self.directory} after its save finished "
                "(no error was reported; was the directory changed meanwhile?); save again."
            )

    def _not_saved(self, step: int, e: BaseException) -> str:
        return (
            f"checkpoint step {step} was not saved to {self.directory}: "
            f"{type(e).__name__}: {storage_error_line(e)}. The checkpoints finished before it "
            "are intact; fix the cause (disk space, permissions, the directory) and save again."
        )

    def wait(self) -> None:
        """Blocks until the asynchronous save in flight is on disk.

        Raises:
            CheckpointSaveError: it failed (the message names the step and the cause).
        """
        self._open(create=False)  # refuses a closed Checkpointer
        self._report_failed_save(block=True)

    def close(self) -> None:
        """Waits for the save in flight, then releases Orbax's resources (also when that
        save failed: the error is raised after, so the process can still exit).

        Raises:
            CheckpointSaveError: the save in flight failed.
        """
        if self._closed:
            return
        try:
            self._report_failed_save(block=True)
        finally:
            self._closed = True
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- reading
    def all_steps(self) -> list[int]:
        """The finished checkpoints' steps on disk, oldest first (also those written by
        other writers; not yet verified); none when the directory does not exist. Also
        after :meth:`close`: it only lists the directory."""
        if self._closed:
            if not os.path.isdir(self.directory):
                return []
            listing = ocp.CheckpointManagerOptions(read_only=True)
            with ocp.CheckpointManager(self.directory, options=listing) as manager:
                return sorted(manager.all_steps())
        manager = self._open(create=False)
        if manager is None:
            return []
        manager.reload()
        return sorted(manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (None: none); see :meth:`restore` for
        the newest *valid* one."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint ``step`` (refused when damaged: its own checksum
        fails)."""
        return read_meta(self._existing(), str(self.directory), step)

    def read(self, step: int, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """Reads the named arrays of checkpoint ``step`` (any subset) into ``targets``'
        shapes and shardings: each device reads its own region, the padded dimension
        truncated or zero-filled (``strict=False``). Checks nothing: see :meth:`restore`."""
        return read_arrays(self._existing(), step, targets)

    # ----------------------------------------------------------------------- restoring
    def restore(
        self, opt: ZeroOptimizer, like: Any, *, step: int | None = None, model_state: Any = None
    ) -> Restored:
        """Restores a checkpoint into ``opt``'s layout (any stage, device count, precision).

        Args:
            opt: the :class:`jzero.ZeroOptimizer` to train on with (its mesh, stage and
                precision; its Optax transformation must be the one saved).
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
            CheckpointNotFoundError: the directory does not exist.
            CheckpointMismatchError: the checkpoint (with ``step=None``: the newest
                readable one) is intact but holds another parameter tree, true shapes or
                Optax state than ``opt`` and ``like``: the message names every difference.
                Never skipped as corrupt.
            CheckpointError: no checkpoint, or (``step`` given) this one is corrupt or
                unreadable: the message names the step and the leaf.
        """
        check_optimizer(opt, "restore()")
        check_runnable(opt.mesh, "jzero.Checkpointer.restore")
        check_like(like)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
            raise TypeError(f"step must be an int or None (the newest valid), got {step!r}.")
        self._existing()  # refuses a closed Checkpointer and a missing directory
        steps = [int(step)] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}.")
        plan = opt.plan(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like))
        skipped: list[tuple[int, str]] = []
        manager, where = self._existing(), str(self.directory)
        for s in steps:
            try:
                if s not in (on_disk := self.all_steps()):
                    raise CheckpointError(f"no checkpoint step {s} in {where} (steps: {on_disk}).")
                state, extra = restore_step(manager, where, plan, opt.precision, s, model_state)
            except CheckpointMismatchError as e:
                if not skipped:
                    raise
                raise CheckpointMismatchError(
                    f"{e} (skipped before it: {_reasons(skipped)})"
                ) from e
            except CheckpointError as e:
                if step is not None:
                    raise
                logger.warning("jzero.Checkpointer: skipping step %d: %s", s, e)
                skipped.append((s, str(e)))
                continue
            return Restored(state, s, extra, tuple(skipped))
        raise CheckpointError(f"no valid checkpoint in {self.directory}: {_reasons(skipped)}")


def _reasons(skipped: list[tuple[int, str]]) -> str:
    return "; ".join(f"step {s}: {r}" for s, r in skipped)
