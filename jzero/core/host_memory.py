"""A value computed on the device, copied into host memory for a host computation to read.

XLA:GPU (jax 0.11.2 and 0.12) fails to compile a host computation
(``compute_on("device_host")``) whose input was copied down in a layout other than
row-major: layout assignment gives the host computation's parameter that layout and leaves
its caller's operand row-major, and the verifier stops the compile ("expects the async
shape at index {0} to be a tuple with shapes that match..."). A gradient made by a matmul
(``x.T @ g``) comes out column-major, so the host optimizer step of any model with a dense
layer failed to compile on one GPU (an H200, 2026-12-01). :func:`to_host` fixes the
layout before the copy, in programs lowered for GPUs (``jax.lax.platform_dependent``):
at most a transpose on the device, the same values. The host step
(:mod:`jzero.core.offload.host_step`) copies its gradients down with it;
``tests/core/offload/test_host_step_gpu_compile.py`` compiles such steps for a
compile-only GPU.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(x: jax.Array) -> jax.Array:
    """``x`` copied into host memory, row-major (a value already there, unchanged)."""
    return x if in_host_memory(x) else jax.device_put(row_major(x), jax.memory.Space.Host)


def put_on_host(x: Any) -> Any:
    """``x`` copied into host memory in its own layout (a value already there, unchanged):
    for values a host computation made, or state that rests row-major."""
    return x if in_host_memory(x) else jax.device_put(x, jax.memory.Space.Host)


def in_host_memory(x: Any) -> bool:
    """Whether the (traced) array ``x`` is in host memory, e.g. an offloaded shard."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def row_major(x: jax.Array) -> jax.Array:
    """``x`` in the row-major layout (XLA's default), or ``x`` as it is where this JAX has
    no ``jax.experimental.layout.with_layout_constraint`` (a compile may then fail as
    described above, with XLA's message)."""
    try:
        from jax.experimental.layout import Layout, with_layout_constraint
    except ImportError:
        return x
    if np.ndim(x) < 2:
        return x  # one layout only
    constrained = lambda x: with_layout_constraint(x, Layout(tuple(range(np.ndim(x)))))
    # On a GPU only: XLA:CPU has no host computations to feed, and the constraint would
    # cost it a copy of the gradient.
    return jax.lax.platform_dependent(x, cuda=constrained, rocm=constrained, default=lambda x: x)
