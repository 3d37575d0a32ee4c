"""Does a checkpoint hold what the caller restores into? Decided from its metadata alone,
before any array is read, so a different model or optimizer is reported as such -- never
as a corrupt checkpoint -- with every differing leaf, shape and Optax state type named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.leaf_names import leaf_names
from ..core.restoring import model_state_names
from .errors import CheckpointMismatchError
from .format import state_types

_GROUPS = (
    ("step", "the step"),
    ("weights", "parameters"),
    ("opt_state", "optimizer state"),
    ("model_state", "model state"),
)
_REQUIRED = ("step", "weights", "opt_state")  # what every restore needs from the checkpoint


def check_match(
    where: str,
    meta: dict[str, Any],
    targets: dict[str, tuple[Any, tuple[int, ...]]],
    opt_def: Any,
    model_state: Any,
) -> None:
    """Raises :class:`CheckpointMismatchError` naming every difference between the
    checkpoint ``meta`` (at ``where``, e.g. ``"checkpoint step 2 in /runs/ckpt"``) and the
    restoring ``targets`` (:func:`jzero.core.restoring.read_targets`): leaves on one side only, true
    shapes or dtypes that differ, and the Optax state types (``opt_def`` 's) when those
    differ too."""
    stored = meta["leaves"]
    problems = _leaf_problems(stored, targets)
    if model_state is not None:
        problems += _model_state_problems(stored, model_state)
    saved_types = meta.get("opt_state_types")  # absent in checkpoints of older jzero
    opt_state_types = state_types(opt_def)
    if problems and saved_types is not None and list(saved_types) != list(opt_state_types):
        problems.append(
            f"the checkpoint's Optax state is ({', '.join(saved_types)}), the restoring "
            f"optimizer's is ({', '.join(opt_state_types)})"
        )
    if problems:
        intact = (
            "it is intact, not corrupt"
            if "meta_checksum" in meta
            else "its metadata, from an older jzero, carries no checksum of its own"
        )
        raise CheckpointMismatchError(
            f"{where} does not match what it is restored into ({intact}): "
            + "; ".join(problems)
            + ". Restore into the parameter tree and Optax transformation the run saved "
            "(true shapes and dtypes must agree; stage, device count and precision may "
            "differ), or keep the new model's checkpoints in another directory."
        )


def _group(name: str) -> str:
    return name.split(".")[0]


def _leaf_problems(stored: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    problems = []
    for group, label in _GROUPS:
        if group == "model_state":
            continue  # taken as the checkpoint holds it; model_state= is checked apart
        missing = [n for n in targets if _group(n) == group and n not in stored]
        if missing and group in _REQUIRED:
            problems.append(f"{label} not in the checkpoint: {_few(missing)}")
        only_saved = [n for n in stored if _group(n) == group and n not in targets]
        if only_saved and group in _REQUIRED:
            problems.append(f"{label} only in the checkpoint: {_few(only_saved)}")
    for name, (target, shape) in targets.items():
        if name not in stored:
            continue
        want = (list(shape), str(target.dtype))
        got = (list(stored[name]["shape"]), stored[name]["dtype"])
        if want != got:
            problems.append(
                f"leaf {name!r} is {got[1]}{got[0]} in the checkpoint but {want[1]}{want[0]} "
                "in the restoring model"
            )
    return problems


def _model_state_problems(stored: dict[str, Any], model_state: Any) -> list[str]:
    saved = model_state_names(stored)
    given = ["model_state" + (f".{n}" if n else "") for n in leaf_names(model_state)]
    problems = []
    if missing := [n for n in given if n not in saved]:
        problems.append(f"model state (model_state=) not in the checkpoint: {_few(missing)}")
    if only_saved := [n for n in saved if n not in given]:
        problems.append(f"model state only in the checkpoint: {_few(only_saved)}")
    return problems


def _few(names: Sequence[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"[{shown}{more}]"
