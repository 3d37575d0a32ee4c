"""Checks on what callers hand to the checkpoint entry points, run before anything is
read or written, so a refused call loses nothing and leaves no file behind."""

from __future__ import annotations

import json
from typing import Any

import optax

from ..core.input_checks import check_leaves
from ..core.plan import ZeroState
from ..optimizers.zero_optimizer import ZeroOptimizer


def check_optimizer(opt: Any, what: str) -> None:
    """``opt`` is the :class:`jzero.ZeroOptimizer` the state belongs to (not its Optax
    transformation)."""
    if isinstance(opt, ZeroOptimizer):
        return
    if isinstance(opt, optax.GradientTransformation):
        raise TypeError(
            f"{what} takes the jzero.ZeroOptimizer, got an Optax transformation "
            f"({type(opt).__name__}); wrap it as the run does: "
            "jzero.ZeroOptimizer(tx, mesh, stage=...) (any stage, mesh and precision: the "
            "state is laid out for that optimizer)."
        )
    raise TypeError(f"{what} takes a jzero.ZeroOptimizer, got {type(opt).__name__}.")


def check_like(like: Any) -> None:
    """``like`` is the parameter tree (arrays or ``jax.ShapeDtypeStruct`` s) at true shapes."""
    if isinstance(like, ZeroState):
        raise TypeError(
            "restore(opt, like) takes the parameters (or jax.eval_shape(init_fn)), not a "
            "jzero.ZeroState; pass the model's parameter tree at its true shapes."
        )
    check_leaves(like, "like", allow_empty=False)


def check_extra(extra: Any) -> None:
    """``extra`` is JSON that comes back exactly as given: dicts with ``str`` keys, lists,
    ``str``, ``bool``, ``None``, ints and finite floats.

    JSON would turn a key ``0`` into ``"0"`` and a tuple into a list, so those are refused
    rather than changed.
    """
    _check_json(extra, "extra")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"extra must be JSON-serialisable (dicts, lists, str, finite numbers): {e}. "
            "Convert arrays with .tolist() or int(...)."
        ) from None


def _check_json(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON keys are "
                    f"strings, so it would come back as {str(key)!r}. Use str keys (e.g. "
                    f"{str(key)!r}) and convert them back after restore."
                )
            _check_json(item, f"{where}[{key!r}]")
    elif isinstance(value, tuple):
        raise TypeError(
            f"{where} is a tuple, which JSON stores as a list (it would come back as one); "
            "pass a list."
        )
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
