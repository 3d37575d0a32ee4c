"""The XLA options jzero's own step is compiled with, per platform.

XLA:GPU's collective pipeliner (``xla_gpu_pipeline_reduce_scatter``, on by default) moves
a loop step's reduce-scatter into the next step, so that it overlaps the next layer's
backward. The reduce-scatter's input, the layer's full gradients, is then carried from
one step into the next, next to the new layer's: at stages 2-3, whose backward loops
reduce-scatter each layer, that is one layer's unsharded gradients more at the peak, the
memory the stage exists to free. jzero's step turns the pipeliner off unless
``Communication(pipeline_scatter=True)`` asks for the overlap. The options go to
``jax.jit(..., compiler_options=...)``: that one program, no process-wide flag.

An option XLA renames is refused at compile time, so each is first tried on a trivial
program; one the installed jaxlib refuses is left out, with a warning (XLA's default
then stands: the step is the same, its memory as XLA's pipeliner makes it).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from ..internal.moved import InternalMoved, warn_fallback
from .options.zero_config import ZeroConfig

PIPELINE_SCATTER = "xla_gpu_pipeline_reduce_scatter"
PIPELINE_OFF = "COLLECTIVE_PIPELINING_MODE_OFF"
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def step_compiler_options(config: ZeroConfig, mesh: Mesh) -> dict[str, str] | None:
    """The options for ``jax.jit`` of jzero's step over ``mesh``; None where XLA's
    defaults stand (not a GPU, the pipeliner asked for, or the option refused). Other
    backends' defaults are kept: the pipeliner is XLA:GPU's."""
    platforms = {d.platform for d in mesh.devices.flat}
    if not platforms <= GPU_PLATFORMS or config.comm.pipeline_scatter:
        return None
    return {PIPELINE_SCATTER: PIPELINE_OFF} if _accepted(PIPELINE_SCATTER, PIPELINE_OFF) else None


@functools.cache
def _accepted(name: str, value: str) -> bool:
    """Whether the installed jaxlib compiles with ``name=value`` (tried once a process)."""
    try:
        jax.jit(lambda: 0, compiler_options={name: value}).lower().compile()
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).splitlines()[0]
        moved = InternalMoved(f"XLA compile option {name}={value} (refused: {reason})")
        fallback = "XLA:GPU may pipeline the step's reduce-scatters into the next loop step"
        warn_fallback("jzero's step on GPUs", moved, fallback, "one layer's full gradients")
        return False
    return True
