"""A program lowered here for GPUs, compiled by XLA's GPU compiler for compile-only GPUs.

``jzero.gpu_mesh``'s compile-only GPUs have no memory kinds, so a state placed in
``pinned_host`` memory cannot be described on them, and a step with offload cannot be
lowered for them. Lowered on this machine's CPU devices (which have ``pinned_host``) for
the ``cuda`` platform instead (``TrainStep.lower(..., platforms=("cuda",))``), the
program keeps its host placements, its host computations (``compute_on``) and its memory
moves; :func:`compile_for` then hands that text to the compile-only GPUs' client, and
XLA's GPU pipeline runs on it (host offloading passes, layout assignment, buffer
assignment) as it would on the GPUs. JAX has no public call for this: it compiles a
lowering only for the devices it was lowered on.

Reads ``jax._src.compiler.get_compile_options`` / ``backend_compile_and_load`` and
``jax._src.interpreters.mlir.make_ir_context``; raises :class:`InternalMoved` when they
are not there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .moved import InternalMoved


def compile_for(text: str, devices: Sequence[Any]) -> Any:
    """The StableHLO ``text`` of a program lowered for ``len(devices)`` GPUs, compiled for
    ``devices`` (compile-only GPUs): XLA's executable, whose
    ``get_compiled_memory_stats()`` holds device and host bytes. Raises XLA's error when
    the GPU compiler refuses the program."""
    compiler, mlir, ir, xc = _internals()
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(devices),
        device_assignment=np.array([[d.id for d in devices]]),
    )
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        return compiler.backend_compile_and_load(
            devices[0].client, module, xc.DeviceList(tuple(devices)), options, []
        )


def _internals() -> tuple[Any, Any, Any, Any]:
    try:
        from jax._src import compiler
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client
        from jax._src.lib.mlir import ir

        for name in ("get_compile_options", "backend_compile_and_load"):
            getattr(compiler, name)
        mlir.make_ir_context  # noqa: B018  (read: raises AttributeError if it moved)
    except (ImportError, AttributeError) as e:
        raise InternalMoved(
            "jax._src.compiler's get_compile_options / backend_compile_and_load and "
            "jax._src.interpreters.mlir.make_ir_context",
            f"is not there ({e})",
        ) from e
    return compiler, mlir, ir, xla_client
