"""Batch-axis names: ``axis_name=`` checked, and a collective over an axis the step does not
have explained.

Inside ``shard_map``, ``lax.psum(x, 'batch')`` on a mesh without ``'batch'`` fails in JAX's
``pvary`` with a bare ``AssertionError``, and ``all_gather`` / ``axis_index`` with
``NameError: unbound axis name``. When the loss fails to trace, :func:`explain_unknown_axis`
traces it again on its own (:func:`jzero.internal.unbound_axes.unbound_axes`) and, if one
of its collectives names an axis that is neither a mesh axis nor an alias, raises an error
that names the axis, the collective, the line that calls it and the fix (``axis_name=``,
:mod:`.axis_alias`). Any other failure is left as it was. An axis the loss binds itself
with ``jax.vmap(..., axis_name=...)`` is never named here (the vmap binds it in that trace
too): the step runs such a loss through :mod:`jzero.internal.vmap_axes` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..internal.unbound_axes import unbound_axes


def explain_unknown_axis(
    error: BaseException, fn: Callable[..., Any], args: Sequence[Any], axis_sizes: Mapping[str, int]
) -> None:
    """Raises a ValueError (from ``error``, the failure of ``fn(*args)``) if a collective in
    ``fn`` names an axis not in ``axis_sizes`` (the step's mesh axes and aliases, with their
    sizes); returns otherwise."""
    found = unbound_axes(fn, args, axis_sizes)
    if not found:
        return
    name, api, where = found[0]
    at = f" (at {where})" if where else ""
    raise ValueError(
        f"loss_fn calls jax.lax.{api} over axis {name!r}{at}, which the step does "
        f"not have (mesh axes and aliases: {tuple(axis_sizes)}). If {name!r} is the model's "
        f"name for the batch axis (e.g. nn.BatchNorm(axis_name={name!r})), build the step "
        f"with train_step(..., axis_name={name!r}): jzero then runs its collectives over the "
        "batch axes. Otherwise add the axis to the mesh."
    ) from error


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
