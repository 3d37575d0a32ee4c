"""hpZ (ZeRO++'s hierarchical partitioning): stage 3's secondary partition over groups of G.

The ``data`` axis (N devices) is cut into N/G = K groups of G consecutive devices (a node:
:func:`jzero.hybrid_mesh` and ``jax.devices()`` list each host's devices together).
Device ``d = k * G + g`` (group ``k``, position ``g``) stores the 1/N shard ``d`` of each
stage-3 parameter, as without hpZ. Its gather runs in two all-gathers:

1. *across* the groups, among the K devices at position ``g`` of every group
   (``lax.all_gather``'s ``axis_index_groups``): shards ``g, G + g, ..., (K-1) G + g``,
   the *secondary* copy, 1/G of the parameter. Forward keeps it for backward (named
   :data:`SECONDARY`, which jzero's remat policies always save): ``+Psi * bytes / G``
   memory per device. With ``Communication(gather_quant=...)`` this gather, the one over
   the slow links, is the quantized one (ZeRO++'s qwZ): each device quantizes its own
   shard as it would for a plain quantized gather, so the values are bit for bit those of
   ``gather_quant`` without hpZ; the secondary copy holds them dequantized.
2. *within* the group, among its G devices: every shard; reordered (a local transpose)
   into the full parameter. Backward redoes only this one, from the saved secondary.

Gradients are reduce-scattered over the whole ``data`` axis as without hpZ. Per device
and step, with S the bytes of the (padded) parameters, stage 3's gathers send in the ring
model ``S (K-1) / N`` across the groups (forward only; without hpZ a flat gather over
every device, forward and backward) and ``2 S (G-1) / G`` within them.

Every function here runs in the per-device (local) view, on flat vectors
(:func:`.buckets.flat_shards`): one leaf, or a bucket's leaves together.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ..mesh import DATA
from ..options.communication import Quant
from .quantize import quantized_rows

SECONDARY = "jzero_secondary"
"""``checkpoint_name`` of a secondary copy (step 1's result), which remat policies save."""


def across_groups(n: int, group: int) -> list[list[int]]:
    """Data-axis indices of the devices at the same position in each group of ``group``."""
    return [list(range(g, n, group)) for g in range(group)]


def within_groups(n: int, group: int) -> list[list[int]]:
    """Data-axis indices of each group of ``group`` consecutive devices."""
    return [list(range(k, k + group)) for k in range(0, n, group)]


def gather_secondary(
    flat: jax.Array, *, group: int, sizes: Sequence[int], quant: Quant | None
) -> jax.Array:
    """This device's flat vector -> its group position's secondary copy, ``[K, total]``:
    row ``k`` is the vector of device ``k * G + g`` (``quant``: sent quantized, each leaf's
    segment of ``sizes`` in blocks of its own, as :func:`.quantize.quantized_all_gather`)."""
    groups = across_groups(jax.lax.axis_size(DATA), group)
    if quant is not None:
        return quantized_rows(flat, sizes=sizes, quant=quant, groups=groups)
    return jax.lax.all_gather(flat, DATA, axis=0, axis_index_groups=groups)


def gather_group(secondary: jax.Array, *, group: int) -> jax.Array:
    """The secondary copies of this device's group -> every device's flat vector,
    ``[N, total]`` in data-axis order (row ``k * G + g``: group ``k``'s device ``g``)."""
    n = jax.lax.axis_size(DATA)
    groups = within_groups(n, group)
    rows = jax.lax.all_gather(secondary, DATA, axis=1, axis_index_groups=groups)  # [K, G, total]
    return rows.reshape(n, -1)
