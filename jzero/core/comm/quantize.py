"""Quantized collectives (ZeRO++): stage 3's parameter all-gathers (qwZ, int8 or fp8) and the
gradient reduce-scatters (qgZ, int8 or int4), with blockwise fp32 scales.

**qwZ.** Each device quantizes its own shard before sending it and every device
dequantizes what it receives. Each leaf's shard (one layer's slice of a stacked leaf, when
stage 3 gathers per layer) is flattened and cut into equal blocks of at most ``block``
elements (the last padded with zeros), and a bucket (:mod:`.buckets`) sends its leaves'
blocks together; each block is sent as int8 values ``round(x / scale)`` with one fp32
``scale = absmax / 127`` (symmetric absmax quantization). So the wire carries 1 byte per
element plus 4 bytes per block: ``0.25 + 1 / block`` of fp32's volume, ``0.5 + 2 / block``
of bf16's (0.254 and 0.508 at ``block=256``), in two all-gathers (the int8 payload and the
scales).

Error: rounding to the nearest step of ``absmax / 127`` moves an element by at most
``absmax / 254`` of its block (|x - x̂| <= scale / 2), up to fp32's rounding of
``x / scale``: a GPU divides within 2 ulp, so a value at a half step may round the wrong
way by 2 ulp of a value below 128 (2**-17 each), and the bound then holds times
``1 + 2**-15`` (the GPU check's ``quant`` piece measures the worst ratio). For N(0, 1)
values in blocks of 256 the relative L2 error ``|x - x̂| / |x|`` of a gathered weight is about 7e-3
(``tests/core/comm/test_quantized_gather.py`` measures it); smaller blocks lower it (and send more
scales). Zeros (the layout's padding, all-zero blocks) are exact. Values are dequantized
in fp32 and cast to the parameter dtype, so with bf16 parameters bf16's own rounding adds
to it. A block holding an inf or NaN dequantizes to non-finite values throughout.

**fp8 gathers** (torchtitan's float8 all-gather, ZeRO++'s qwZ in fp8): the same blocks,
each sent as float8_e4m3fn values ``x / scale`` rounded to nearest (ties to even) with
``scale = absmax / 448``, so the block's absmax lands on e4m3's largest finite value. The
same bytes as int8 (1 per element plus 4 per block; sent as their bytes, ``u8``, since
XLA:CPU widens an f8 all-gather to f16), but a float's error is relative: e4m3 keeps 3
mantissa bits, so with ``y = |x| / scale`` an element moves by at most half the e4m3
spacing at ``y``::

    |x - x̂| <= scale * 2 ** (max(floor(log2(y)), -6) - 4)
             <= max(|x| / 16, scale * 2 ** -10)

(fp32's own rounding of ``x / scale`` and ``q * scale`` aside): at most 1/16 of ``|x|``
in e4m3's normal range (``y >= 2 ** -6``, i.e. ``|x| >= absmax / 28672``), at most
``absmax / 458752`` below it, where e4m3's subnormals are spaced ``2 ** -9``. The bound is
reached (``tests/core/comm/test_fp8_gather.py`` checks it element by element, and that it is tight).
Its relative L2 error is about 2.6e-2 on N(0, 1) values at ``block=256``, nearly
independent of the block size, where int8's is 7e-3: near a block's absmax e4m3's steps
are coarser than int8's. fp8 is the better of the two where a block mixes a few large
values with many small ones (heavy tails, outliers), whose int8 steps the large values
coarsen: with one element in 10^4 a hundred times larger, the other elements' relative
L2 error is 2.6e-2 (fp8) against 3.8e-2 (int8), and 2.6e-2 against 0.14 at a thousand
times. One fp32 scale per block, as int8, rather than one per tensor (per leaf shard):
the error is the same or lower on every set measured (N(0, 1): 2.61e-2 against 2.64e-2;
Student-t with 3 degrees of freedom: 2.30e-2 against 2.60e-2), for 1.6 % more bytes
than fp8 values alone; a large ``block`` (4096: 0.2502x fp32) comes within 0.1 % of one
scale per shard's bytes (``tests/core/comm/test_fp8_gather.py`` measures these).

Gradient: straight-through. Quantization happens inside jzero's gather (a ``custom_vjp``
whose backward reduce-scatters the cotangent in the reduce dtype), so the gradient a step
gets is exactly the gradient of the loss at the dequantized parameters.

**qgZ.** A reduce-scatter's message is ``[N, total]``, row j the part device j owns. Each
device quantizes every row (each leaf's segment in blocks of its own; int8 with
``absmax / 127``, or int4 with ``absmax / 7``, two values packed a byte), sends row j to
device j in one all-to-all (with the fp32 scales in a second), and each owner dequantizes
the N parts it receives and sums them in fp32: 0.25 + 1 / block (int8) or 0.125 + 1 /
block (int4) of fp32's volume. Each part is quantized once (no re-quantized partial
sums), with stochastic rounding: unbiased, so errors average out over devices and steps
instead of adding up, and within one step, ``absmax / 127`` (int8) or ``absmax / 7``
(int4) of its block, per device. The dither is a hash of each value, its position and
the device index (:func:`_uniform`): reproducible, no PRNG state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp

from ..leaf_layout import LeafLayout
from ..mesh import DATA
from ..options.communication import Quant
from .buckets import all_gather_flat, reduce_scatter_flat

FP8 = jnp.float8_e4m3fn
"""The wire dtype of fp8 gathers: 4 exponent bits, 3 mantissa bits, no infinities."""
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value, where a block's absmax lands."""


def _levels(dtype: str) -> float:
    """The largest magnitude a quantized value takes: 127 (int8), 7 (int4) or 448 (fp8)."""
    if dtype == "fp8":
        return FP8_MAX
    return 7 if dtype == "int4" else 127


def _blocks(total: int, block: int, *, even: bool = False) -> tuple[int, int]:
    """(number of blocks, elements per block): the fewest equal blocks of <= ``block``
    (``even``: an even number of elements, rounded up, for int4's two values a byte)."""
    count = max(-(-total // block), 1)
    size = max(-(-total // count), 1)
    return count, size + (size % 2 if even else 0)


def _uniform(x: jax.Array, salt: jax.Array) -> jax.Array:
    """A value in [0, 1) per element, hashed from its bits, position and ``salt``: the
    dither of stochastic rounding, reproducible (no PRNG state) and new whenever the
    values change."""
    h = jax.lax.bitcast_convert_type(x, jnp.uint32)
    h = h ^ (jax.lax.broadcasted_iota(jnp.uint32, x.shape, x.ndim - 1) * jnp.uint32(0x9E3779B9))
    for i in range(x.ndim - 1):
        h = h ^ (jax.lax.broadcasted_iota(jnp.uint32, x.shape, i) * jnp.uint32(0x85EBCA6B + 2 * i))
    h = h ^ salt.astype(jnp.uint32) * jnp.uint32(0xC2B2AE35)
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def quantize(
    x: jax.Array, *, block: int, dtype: str = "int8", salt: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``[..., n]`` -> (values ``[..., blocks, size]``, fp32 scales ``[..., blocks]``).

    Symmetric absmax per block of the last axis, to ``dtype``'s levels (the int4 values
    still one per int8; :func:`pack_int4` halves them). Rounded to nearest,
    ``dequantize`` inverts it to within ``scale / 2``; with a ``salt`` (an unsigned int),
    stochastically (up with probability the fractional part, dithered by
    :func:`_uniform`): within ``scale``, and unbiased. ``'fp8'``: float8_e4m3fn values,
    rounded to nearest only, within half e4m3's spacing at ``|x| / scale`` (the module's
    docstring gives the bound).
    """
    if dtype == "fp8" and salt is not None:
        raise ValueError("fp8 values are rounded to nearest only; quantize them without salt.")
    n, levels = x.shape[-1], _levels(dtype)
    count, size = _blocks(n, block, even=dtype == "int4")
    x = x.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, count * size - n)])
    x = x.reshape(*x.shape[:-1], count, size)
    scale = jnp.max(jnp.abs(x), axis=-1) / levels
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))  # an all-zero block stays 0
    y = x / safe[..., None]
    if dtype == "fp8":  # |y| <= 448 up to fp32 rounding, which e4m3 rounds back to 448
        return jnp.clip(y, -levels, levels).astype(FP8), scale
    y = jnp.round(y) if salt is None else jnp.floor(y + _uniform(x, salt))
    q = jnp.clip(y, -levels, levels).astype(jnp.int8)
    return q, scale


def pack_int4(q: jax.Array) -> jax.Array:
    """int8 values in [-7, 7], last axis even -> uint8 bytes holding two each (half the size)."""
    u = (q + 8).astype(jnp.uint8).reshape(*q.shape[:-1], -1, 2)
    return u[..., 0] | (u[..., 1] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """:func:`pack_int4`'s bytes -> the int8 values."""
    pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], -1).astype(jnp.int8) - 8


def dequantize(q: jax.Array, scale: jax.Array, *, size: int, dtype: jnp.dtype) -> jax.Array:
    """int8 or fp8 blocks ``[..., blocks, block]`` and scales ``[..., blocks]`` ->
    ``[..., size]``."""
    x = q.astype(jnp.float32) * scale[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :size].astype(dtype)


def _to_wire(q: jax.Array) -> jax.Array:
    """Quantized values as the collective sends them: fp8 as its bytes (u8), since XLA:CPU
    widens an f8 all-gather to f16 (twice the bytes); int8 as it is."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8) if q.dtype == FP8 else q


def _from_wire(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """:func:`_to_wire` undone: the received bytes as ``dtype`` values."""
    return w if w.dtype == dtype else jax.lax.bitcast_convert_type(w, dtype)


def quantized_rows(
    flat: jax.Array,
    *,
    sizes: Sequence[int],
    quant: Quant,
    groups: Sequence[Sequence[int]] | None = None,
) -> jax.Array:
    """This device's flat vector -> every device's, ``[N, total]``, sent quantized
    (``groups``: the devices of this one's group only, ``[group size, total]``, as
    ``lax.all_gather``'s ``axis_index_groups``).

    Each leaf's segment (``sizes``) has blocks of its own, so a bucket's values are those
    of its leaves gathered one by one.
    """
    bounds = list(itertools.accumulate(sizes))[:-1]
    parts = [quantize(seg, block=quant.block, dtype=quant.dtype) for seg in jnp.split(flat, bounds)]
    q = jnp.concatenate([p.reshape(-1) for p, _ in parts])
    scales = jnp.concatenate([scale for _, scale in parts])
    gather = partial(jax.lax.all_gather, axis_name=DATA, axis=0, axis_index_groups=groups)
    q_all = _from_wire(gather(_to_wire(q)), q.dtype)  # [N, blocks x size] s8/u8
    scales_all = gather(scales)  # [N, blocks] f32
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

    As :func:`jzero.core.comm.buckets.all_gather_flat` (one message for all ``shards``, padding
    trimmed by a negative ``lax.pad``), the message sent as int8 blocks (each leaf's own)
    (or fp8 blocks, as bytes) and their fp32 scales: two all-gathers.
    """
    sizes = [math.prod(x.shape) for x in shards]
    rows = lambda flat: quantized_rows(flat, sizes=sizes, quant=quant)
    return all_gather_flat(shards, layouts, rows_of=rows)


def _quantized_sum(rows: jax.Array, *, sizes: Sequence[int], quant: Quant) -> jax.Array:
    """Every device's ``[N, total]`` (row j: the part device j owns) -> this device's
    ``[total]``: the sum over devices, each part sent quantized in one all-to-all.

    Each leaf's segment of a row (``sizes``) has blocks of its own. The owner dequantizes
    the N parts it receives and sums them in fp32, so each device's part is quantized
    once and the sum adds no rounding of its own beyond fp32's.
    """
    bounds = list(itertools.accumulate(sizes))[:-1]
    salt = jax.lax.axis_index(DATA)  # devices holding equal values round them independently
    parts = [
        quantize(seg, block=quant.block, dtype=quant.dtype, salt=salt)
        for seg in jnp.split(rows, bounds, axis=1)
    ]
    n = rows.shape[0]
    send = [q if quant.dtype == "int8" else pack_int4(q) for q, _ in parts]
    payload = jnp.concatenate([x.reshape(n, -1) for x in send], axis=1)
    scales = jnp.concatenate([scale for _, scale in parts], axis=1)
    payload = jax.lax.all_to_all(payload, DATA, 0, 0, tiled=True)  # [N, ...] s8 / u8
    scales = jax.lax.all_to_all(scales, DATA, 0, 0, tiled=True)  # [N, blocks] f32
    out, p_at, s_at = [], 0, 0
    for (q, _), x, size in zip(parts, send, sizes):
        count, per = q.shape[1:]
        width = math.prod(x.shape[1:])
        got = payload[:, p_at : p_at + width].reshape(n, count, -1)
        got = got if quant.dtype == "int8" else unpack_int4(got)
        part = dequantize(got, scales[:, s_at : s_at + count], size=size, dtype=jnp.float32)
        out.append(part.sum(axis=0))
        p_at, s_at = p_at + width, s_at + count
    return jnp.concatenate(out).astype(rows.dtype)


def quantized_reduce_scatter(
    grads: Sequence[jax.Array], layouts: Sequence[LeafLayout], *, quant: Quant
) -> list[jax.Array]:
    """Local full gradients (one dtype) -> this device's shards of their sums over devices
    (ZeRO++'s qgZ).

    As :func:`jzero.core.comm.buckets.reduce_scatter_flat`, the ``psum_scatter`` replaced by an
    all-to-all of int8 (or packed int4) blocks and their fp32 scales, summed in fp32 by
    each part's owner.
    """
    rows_sum = lambda rows, sizes: _quantized_sum(rows, sizes=sizes, quant=quant)
    return reduce_scatter_flat(grads, layouts, rows_sum=rows_sum)
