"""One saved step read with Orbax: its metadata, checked, and its arrays, verified.

:func:`read_meta` refuses a step whose metadata is unreadable, not jzero's, of another
format version or damaged. :func:`read_arrays` reads any named arrays into the shapes and
shardings asked for; :func:`read_verified` also checks each against the checksum saved with
it. Every failure is a :class:`CheckpointError` naming the step and, where known, the leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from ..core.checksum import checksums
from ..core.restoring import Targets
from .errors import CheckpointError, storage_error_line
from .format import FORMAT, VERSION, meta_damage


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


def read_verified(
    manager: ocp.CheckpointManager, step: int, targets: Targets, stored: dict[str, Any]
) -> dict[str, jax.Array]:
    """The arrays of ``targets`` (name: (target, true shape)) read from step ``step``, in
    the targets' order, each verified against its checksum in ``stored`` (the metadata's
    leaves)."""
    arrays = read_arrays(manager, step, {k: t for k, (t, _) in targets.items()})
    arrays = {k: arrays[k] for k in targets}
    names = list(targets)
    sums = checksums([arrays[k] for k in names], [targets[k][1] for k in names])
    for name, got in zip(names, sums):
        if got != stored[name]["checksum"]:
            raise CheckpointError(
                f"checkpoint step {step}: leaf {name!r} fails its checksum (stored "
                f"{stored[name]['checksum']}, read {got}): the data files are corrupt."
            )
    return arrays


def _leaf_hint(message: str, targets: Mapping[str, Any]) -> str:
    found = [k for k in targets if k in message]
    return f"; leaf {max(found, key=len)!r}" if found else ""
