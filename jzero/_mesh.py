"""The device mesh: jzero partitions along its ``data`` axis and leaves other axes alone."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
"""Name of the mesh axis that jzero partitions model states along."""


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over ``devices`` (default: all devices) named ``'data'``.

    The axis is ``AxisType.Auto`` so that the Optax update, which runs in the global view,
    may contract over sharded dimensions (see DESIGN.md, "Traps").

    Examples:
        >>> mesh = jzero.data_mesh()
        >>> mesh.shape['data'] == jax.device_count()
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("data_mesh() got an empty device list; pass at least one jax.Device.")
    return Mesh(np.array(devices), (DATA,), axis_types=(AxisType.Auto,))


def check_mesh(mesh: Mesh) -> int:
    """Validates ``mesh`` for jzero and returns the size of its ``data`` axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            "build one with jzero.data_mesh() or jax.make_mesh(..., ('data', ...))."
        )
    if DATA not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names} but no {DATA!r} axis, which jzero partitions along; "
            "use jzero.data_mesh() or name one axis 'data', e.g. "
            "jax.make_mesh((n, m), ('data', 'model'))."
        )
    explicit = [
        name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit
    ]
    if explicit:
        raise ValueError(
            f"mesh axes {explicit} are AxisType.Explicit; jzero runs the Optax update in the "
            "global view, where explicit axes make ordinary Optax code fail. Build the mesh "
            "with axis_types=(jax.sharding.AxisType.Auto, ...)."
        )
    return mesh.shape[DATA]
