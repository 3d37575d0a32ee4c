"""Quantized all-gathers of stage 3's parameters (ZeRO++'s qwZ): int8 with blockwise scales.

Each device quantizes its own shard before sending it and every device dequantizes what it
receives. Each leaf's shard (one layer's slice of a stacked leaf, when stage 3 gathers per layer)
is flattened and cut into equal blocks of at most ``block`` elements (the last padded
with zeros), and a bucket (:mod:`.buckets`) sends its leaves' blocks together; each
block is sent as int8 values ``round(x / scale)`` with one fp32 ``scale = absmax / 127``
(symmetric absmax quantization). So the wire carries 1 byte per element plus 4 bytes per
block: ``0.25 + 4 / block`` of fp32's volume, ``0.5 + 8 / block`` of bf16's (0.266 and
0.531 at ``block=256``), in two all-gathers (the int8 payload and the scales).

Error: rounding to the nearest step of ``absmax / 127`` moves an element by at most
``absmax / 254`` of its block (|x - x̂| <= scale / 2). For N(0, 1) values in blocks of 256
the relative L2 error ``|x - x̂| / |x|`` of a gathered weight is about 7e-3
(``tests/test_quantized_gather.py`` measures it); smaller blocks lower it (and send more
scales). Zeros (the layout's padding, all-zero blocks) are exact. Values are dequantized
in fp32 and cast to the parameter dtype, so with bf16 parameters bf16's own rounding adds
to it. A block holding an inf or NaN dequantizes to NaN throughout.

Gradient: straight-through. Quantization happens inside jzero's gather (a ``custom_vjp``
whose backward reduce-scatters the cotangent, unquantized, in the reduce dtype), so the
gradient a step gets is exactly the gradient of the loss at the dequantized parameters.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from .buckets import all_gather_flat
from .layout import LeafLayout
from .mesh import DATA

GATHER_QUANTS = ("int8",)
"""The values ``Precision.gather_quant`` accepts besides None."""


@dataclasses.dataclass(frozen=True)
class Quant:
    """How a parameter all-gather is quantized (static: hashable, part of the trace).

    Attributes:
        dtype: the wire dtype of the values; only ``'int8'``.
        block: at most this many consecutive elements share one fp32 scale.
    """

    dtype: Literal["int8"] = "int8"
    block: int = 256


def _blocks(total: int, block: int) -> tuple[int, int]:
    """(number of blocks, elements per block): the fewest equal blocks of <= ``block``."""
    count = max(-(-total // block), 1)
    return count, max(-(-total // count), 1)


def quantize(flat: jax.Array, *, block: int) -> tuple[jax.Array, jax.Array]:
    """A flat vector -> (int8 values [blocks, size], fp32 scales [blocks]).

    Symmetric absmax per block; ``dequantize`` inverts it to within ``scale / 2``.
    """
    count, size = _blocks(flat.size, block)
    x = jnp.pad(flat.astype(jnp.float32), (0, count * size - flat.size)).reshape(count, size)
    scale = jnp.max(jnp.abs(x), axis=1) / 127
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))  # an all-zero block stays 0
    q = jnp.clip(jnp.round(x / safe[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, *, size: int, dtype: jnp.dtype) -> jax.Array:
    """int8 blocks ``[..., blocks, block]`` and scales ``[..., blocks]`` -> ``[..., size]``."""
    x = q.astype(jnp.float32) * scale[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :size].astype(dtype)


def _quantized_rows(flat: jax.Array, *, sizes: Sequence[int], quant: Quant) -> jax.Array:
    """This device's flat vector -> every device's, ``[N, total]``, sent quantized.

    Each leaf's segment (``sizes``) has blocks of its own, so a bucket's values are those
    of its leaves gathered one by one.
    """
    bounds = list(itertools.accumulate(sizes))[:-1]
    parts = [quantize(seg, block=quant.block) for seg in jnp.split(flat, bounds)]
    q = jnp.concatenate([p.reshape(-1) for p, _ in parts])
    scales = jnp.concatenate([scale for _, scale in parts])
    q_all = jax.lax.all_gather(q, DATA, axis=0, tiled=False)  # [N, sum of blocks x size] s8
    scales_all = jax.lax.all_gather(scales, DATA, axis=0, tiled=False)  # [N, blocks] f32
    rows, q_at, s_at = [], 0, 0
    for (p, _), size in zip(parts, sizes):
        count, per = p.shape
        blocks = q_all[:, q_at : q_at + count * per].reshape(-1, count, per)
        rows.append(
            dequantize(blocks, scales_all[:, s_at : s_at + count], size=size, dtype=flat.dtype)
        )
        q_at, s_at = q_at + count * per, s_at + count
    return jnp.concatenate(rows, axis=1)


def quantized_all_gather(
    shards: Sequence[jax.Array], layouts: Sequence[LeafLayout], *, quant: Quant
) -> list[jax.Array]:
    """Local shards (one dtype) -> full leaves of the true shapes, gathered quantized.

    As :func:`jzero.core.buckets.all_gather_flat` (one message for all ``shards``, padding
    trimmed by a negative ``lax.pad``), the message sent as int8 blocks (each leaf's own)
    and their fp32 scales: two all-gathers.
    """
    sizes = [math.prod(x.shape) for x in shards]
    rows = lambda flat: _quantized_rows(flat, sizes=sizes, quant=quant)
    return all_gather_flat(shards, layouts, rows_of=rows)
