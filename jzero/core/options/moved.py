"""Options that moved to another option object, and the error that names their new home.

The configuration's restructure gathered loose keyword arguments into option objects:
quantized collectives left :class:`jzero.Precision`, and ``bucket`` / ``prefetch`` left
``train_step``, for :class:`jzero.Communication`; ``offload_chunk`` left ``ZeroOptimizer``
for :class:`jzero.Offload`; ``param_specs``, ``rules`` and ``min_shard_size`` are a
:class:`jzero.ZeroConfig`'s :class:`jzero.Layout`. :data:`MOVED` is that move, in one
place; :func:`refuse_moved` turns an old keyword into a ``TypeError`` that says where it
went, and :func:`names_moved_options` gives an option class that check.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple


class Home(NamedTuple):
    """Where a moved option lives now."""

    cls: str  # the option class, e.g. "Communication"
    field: str  # its field there
    keyword: str  # how the option object is passed, e.g. "comm"
    to: str  # to what; "{args}" stands for the fields as given, e.g. "rules=[...]"
    also: str = ""  # other fields the new spelling needs, e.g. "optimizer='stream', "


_OPTIMIZER = "ZeroOptimizer or jzero.ZeroConfig"
_CONFIG = "jzero.ZeroConfig, or {args} to ZeroOptimizer itself"
MOVED: dict[str, Home] = {
    "gather_quant": Home("Communication", "gather_quant", "comm", _OPTIMIZER),
    "grad_quant": Home("Communication", "grad_quant", "comm", _OPTIMIZER),
    "quant_block": Home("Communication", "quant_block", "comm", _OPTIMIZER),
    "bucket": Home("Communication", "bucket", "comm", _OPTIMIZER),
    "prefetch": Home("Communication", "prefetch", "comm", _OPTIMIZER),
    "offload_chunk": Home("Offload", "chunk", "offload", _OPTIMIZER, "optimizer='stream', "),
    "param_specs": Home("Layout", "param_specs", "layout", _CONFIG),
    "rules": Home("Layout", "rules", "layout", _CONFIG),
    "min_shard_size": Home("Layout", "min_shard_size", "layout", _CONFIG),
}
"""Old keyword -> where it lives now. A keyword a caller still accepts is never refused."""


def refuse_moved(what: str, given: Mapping[str, Any], accepted: Collection[str]) -> None:
    """Raises ``TypeError`` naming the new home of each keyword of ``given`` that moved
    (and that ``what``, e.g. ``"Precision"``, does not accept); returns otherwise."""
    moved = [name for name in given if name in MOVED and name not in accepted]
    if not moved:
        return
    by_home: dict[str, list[str]] = {}
    for name in moved:
        by_home.setdefault(MOVED[name].cls, []).append(name)
    args = ", ".join(f"{name}={given[name]!r}" for name in moved)
    fixes = "; ".join(_fix(names, given) for names in by_home.values())
    raise TypeError(f"{what}({args}): {fixes}.")


def _fix(names: list[str], given: Mapping[str, Any]) -> str:
    """'gather_quant moved to jzero.Communication: pass comm=jzero.Communication(...) to ...'."""
    home = MOVED[names[0]]
    renamed = ", ".join(MOVED[name].field for name in names if MOVED[name].field != name)
    moved = (
        ", ".join(names) + f" moved to jzero.{home.cls}" + (f" (as {renamed})" if renamed else "")
    )
    fields = ", ".join(f"{MOVED[name].field}={given[name]!r}" for name in names)
    new = f"{home.keyword}=jzero.{home.cls}({home.also}{fields})"
    args = ", ".join(f"{name}={given[name]!r}" for name in names)
    return f"{moved}: pass {new} to {home.to.format(args=args)}"


def names_moved_options(cls: type) -> type:
    """Class decorator for an option dataclass: an old keyword (:data:`MOVED`) that is not
    one of its fields raises ``TypeError`` naming its new home; any other keyword reaches
    the dataclass's own ``__init__`` (and its own ``TypeError`` when unknown)."""
    init = cls.__init__
    fields = frozenset(f.name for f in dataclasses.fields(cls))

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_moved(cls.__name__, kwargs, fields)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
