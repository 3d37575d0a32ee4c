"""Telling compile-only GPUs (:func:`.topology.gpu_mesh`'s) from devices that run, and
refusing what would run on them.

XLA describes such devices through a compile-only client: programs lower and compile for
them, but no array can be placed on them, and memory kinds (``pinned_host``) are dropped
in their compiles, so an offloaded state would compile as device memory.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

COMPILE_ONLY_RUNTIME = "compile_only_runtime"
"""``device.client.runtime_type`` of the devices a topology description gives."""


def is_compile_only(mesh_or_devices: Mesh | jax.Device | Any) -> bool:
    """Whether ``mesh_or_devices`` (a mesh, a device, or devices) holds compile-only devices,
    such as those of :func:`jzero.gpu_mesh`: programs compile for them but cannot run.

    Examples:
        >>> jzero.core.gpu_target.is_compile_only(jzero.data_mesh())
        False
    """
    if isinstance(mesh_or_devices, Mesh):
        devices = mesh_or_devices.devices.flat
    elif isinstance(mesh_or_devices, jax.Device):
        devices = [mesh_or_devices]
    else:
        devices = np.asarray(mesh_or_devices, dtype=object).flat
    return any(_compile_only(d) for d in devices)


def _compile_only(device: Any) -> bool:
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", None) == COMPILE_ONLY_RUNTIME


def check_runnable(mesh: Mesh, what: str) -> None:
    """Raises if ``mesh``'s devices are compile-only; ``what`` names the call that would
    run on them (e.g. ``"ZeroOptimizer.init"``), and the message what takes them."""
    if is_compile_only(mesh):
        kind = mesh.devices.flat[0].device_kind
        raise RuntimeError(
            f"{what} would run on the mesh's devices, but these are compile-only GPUs from "
            f"jzero.gpu_mesh ({mesh.devices.size} x {kind}), where nothing runs. What takes "
            "them compiles: jzero.autoconfigure(..., mesh=mesh) plans for them; a "
            "ZeroOptimizer's state is jax.eval_shape(*opt.init_program(init_fn=...)), its "
            "step opt.train_step(loss_fn).lower(state, batch).compile(), read by "
            "jzero.report(step, state, batch); jzero.shard_params takes "
            "jax.ShapeDtypeStructs and returns them sharded; any function: compile with "
            "jax.jit(...).trace(...).lower().compile() and read its memory_analysis(). To "
            "run, use a mesh of real devices, e.g. jzero.data_mesh()."
        )


def check_offload_target(mesh: Mesh, offload: Any) -> None:
    """Refuses an offload (anything in host memory) on compile-only devices, whose compiles
    drop memory kinds: what they report for it would not be true."""
    if offload.offloads and is_compile_only(mesh):
        raise ValueError(
            f"{offload} with a mesh of compile-only GPUs (jzero.gpu_mesh): XLA drops memory "
            "kinds on them, so the host-memory state would compile as device memory and no "
            "offload figure read from it would be true. Compile with offload=None here, and "
            "measure offload on real GPUs."
        )
