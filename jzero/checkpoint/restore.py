"""One checkpoint step restored, top to bottom.

:func:`restore_step` reads the step's metadata (its own checksum checked: damage is
corruption), asks the core what the restoring plan reads (each array's target shape, dtype
and sharding, and its true shape), checks the checkpoint holds that (else a
:class:`CheckpointMismatchError`, decided before any array is read), reads the arrays,
verifies each against its checksum, and has the core assemble the :class:`ZeroState`. A
step that is missing, unreadable, damaged or corrupt raises a plain
:class:`CheckpointError` naming it.
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp

from ..core.options.precision import Precision
from ..core.plan import Plan, ZeroState
from ..core.restoring import assemble, read_targets
from .match import check_match
from .reading import read_meta, read_verified


def restore_step(
    manager: ocp.CheckpointManager,
    where: str,
    plan: Plan,
    precision: Precision,
    step: int,
    model_state: Any,
) -> tuple[ZeroState, Any]:
    """Checkpoint ``step`` (of the directory ``where`` names) laid out as ``plan`` says:
    the state and the ``extra`` saved with it."""
    meta = read_meta(manager, where, step)
    targets = read_targets(plan, precision, meta["leaves"])
    check_match(f"checkpoint step {step} in {where}", meta, targets, plan.opt_def, model_state)
    arrays = read_verified(manager, step, targets, meta["leaves"])
    return assemble(plan, precision, arrays, model_state), meta.get("extra")
