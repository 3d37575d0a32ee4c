"""Batch-axis names: ``axis_name=`` checked, and a collective over an axis the step does
not have explained.

Inside ``shard_map``, ``lax.psum(x, 'batch')`` on a mesh without ``'batch'`` fails in JAX's
``pvary`` with a bare ``AssertionError``, and ``all_gather`` / ``axis_index`` with
``NameError: unbound axis name``; :func:`unknown_axis_error` re-raises either as an error
that names the axis, the collective and the fix (``axis_name=``, :mod:`.axis_alias`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from jax._src.lax import parallel as _parallel  # its frames hold the axis names


@contextmanager
def unknown_axis_error(*, mesh_axes: Sequence[str], aliases: Sequence[str]) -> Iterator[None]:
    """Re-raises JAX's error for a collective over an axis the mesh lacks as a ValueError
    that names the axis, the collective and the fix (``axis_name=``)."""
    try:
        yield
    except (AssertionError, NameError) as e:
        found = _unknown_axis(e, set(mesh_axes) | set(aliases))
        if found is None:
            raise
        name, api = found
        known = tuple(mesh_axes) + tuple(aliases)
        raise ValueError(
            f"loss_fn calls jax.lax.{api} over axis {name!r}, which the step does not have "
            f"(mesh axes and aliases: {known}). If {name!r} is the model's name for the batch "
            f"axis (e.g. nn.BatchNorm(axis_name={name!r})), build the step with "
            f"train_step(..., axis_name={name!r}): jzero then runs its collectives over the "
            "batch axes. Otherwise add the axis to the mesh."
        ) from e


def _unknown_axis(e: BaseException, known: set[str]) -> tuple[str, str] | None:
    """(axis, collective) from the frames of ``jax.lax``'s collectives in ``e``'s traceback:
    the outermost of them is the function the model called, and its ``axis_name``."""
    tb, parallel = e.__traceback__, os.path.abspath(_parallel.__file__)
    while tb is not None:
        frame = tb.tb_frame
        if os.path.abspath(frame.f_code.co_filename) == parallel:
            names = frame.f_locals.get("axis_name")
            names = (names,) if isinstance(names, str) else names
            unknown = [n for n in names or () if isinstance(n, str) and n not in known]
            if unknown:
                return unknown[0], frame.f_code.co_name
        tb = tb.tb_next
    return None


def as_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_aliases(axis_name: Any, mesh_axes: Sequence[str]) -> tuple[str, ...]:
    """``axis_name=`` (None, a name or a tuple of names) -> a tuple of new axis names."""
    if not (axis_name is None or isinstance(axis_name, str | tuple)):
        raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}.")
    names = () if axis_name is None else as_tuple(axis_name)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}.")
        if n in mesh_axes:
            raise ValueError(
                f"axis_name={n!r} is already an axis of the mesh {tuple(mesh_axes)}; pass only "
                "the model's own names for the batch axis (the mesh's axes need no alias)."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name {names} names an axis twice.")
    return names
