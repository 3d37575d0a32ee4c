"""``layers=`` for both Flax adapters: the Module classes gathered per layer."""

from __future__ import annotations

from typing import Any


def layer_classes(layers: Any, base: type, what: str) -> tuple[type, ...]:
    """``layers`` (a class or a tuple of classes) as a tuple of subclasses of ``base``, or
    a TypeError naming what was given; ``what`` names ``base`` in the message."""
    classes = layers if isinstance(layers, tuple) else (layers,)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, base)):
            raise TypeError(
                f"layers= takes {what} class or a tuple of them (e.g. layers=Block), "
                f"got {c!r} of type {type(c).__name__}."
            )
    return classes
