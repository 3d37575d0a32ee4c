"""How gradients are summed over the data axis: the :class:`Reducer` strategy.

Exact (``psum_scatter`` in the precision's reduce dtype) or quantized (ZeRO++'s qgZ,
:mod:`.quantize`), leaf by leaf or as one flat collective per layer (:mod:`.buckets`).
Built once from the run's configuration (:meth:`Reducer.of`); every reduce-scatter of a
step -- after backward at stage 1, inside backward at stages 2/3 (:mod:`.gatherer`'s
handles, prefetched scans) -- goes through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..grad_average import dtype_for
from ..leaf_layout import LeafLayout, pad
from ..mesh import DATA
from ..options.communication import Quant
from ..options.zero_config import ZeroConfig
from ..plan import Plan
from .buckets import reduce_scatter_flat
from .quantize import quantized_reduce_scatter


@dataclasses.dataclass(frozen=True)
class Reducer:
    """How a step reduce-scatters its gradients (static: hashable, part of the trace).

    Attributes:
        dtype: the dtype gradients are reduced in (``Precision.reduce_dtype``).
        quant: how they are quantized on the wire (``Communication.grad_quant``), or None.
        host_copies: backward also makes a host copy of each reduced shard of an offloaded
            leaf where it reduces it (:meth:`host_copy`): ZeRO-Offload's gradient copy
            during backward, for the host step (:func:`makes_host_copies`;
            :meth:`host_copied` says which leaves).
    """

    dtype: np.dtype
    quant: Quant | None = None
    host_copies: bool = False

    @classmethod
    def of(cls, config: ZeroConfig) -> Reducer:
        """The reducer ``config`` asks for."""
        dtype = np.dtype(config.precision.reduce_dtype)
        return cls(dtype, config.comm.grad_quantizer, makes_host_copies(config))

    def host_copied(self, plan: Plan) -> tuple[bool, ...]:
        """Per parameter leaf, whether backward makes a host copy of its reduced shard
        (:attr:`host_copies`): a sharded leaf whose optimizer state rests on the host,
        unless hybrid (the shard is all-reduced across replicas after backward)."""
        if not self.host_copies or plan.hybrid:
            return (False,) * len(plan.params)
        return tuple(lay.sharded and on for lay, on in zip(plan.layouts, plan.offloaded))

    def host_copy(self, grads: list, copied: tuple[bool, ...]) -> list:
        """The host copies of the reduced ``grads`` that ``copied`` marks (None elsewhere),
        made here: inside backward, as soon as each is reduced."""
        to_host = lambda g: jax.device_put(g, jax.memory.Space.Host)
        return [to_host(g) if c else None for g, c in zip(grads, copied)]

    def scatter(self, grads: list, layouts: Any, *, flat: bool = False) -> list:
        """Local full gradients -> this device's shards of their sums over 'data', in
        :attr:`dtype`: one collective per leaf, or (``flat``) one flat one per call."""
        grads = [g.astype(dtype_for(g, self.dtype)) for g in grads]
        if flat:
            return scatter_flat(grads, layouts, self.quant)
        return [reduce_scatter(g, lay, self.quant) for g, lay in zip(grads, layouts)]


def reduce_scatter(grad: jax.Array, layout: LeafLayout, quant: Quant | None = None) -> jax.Array:
    """Local full gradient -> this device's shard of the sum over devices (``quant``: sent
    quantized, :func:`.quantize.quantized_reduce_scatter`)."""
    if quant is not None:
        return quantized_reduce_scatter([grad], [layout], quant=quant)[0]
    return jax.lax.psum_scatter(
        pad(grad, layout), DATA, scatter_dimension=layout.axis(grad), tiled=True
    )


def scatter_flat(grads: list, layouts: Any, quant: Quant | None) -> list:
    """:func:`.buckets.reduce_scatter_flat`, or its quantized form with ``quant``."""
    if quant is not None:
        return quantized_reduce_scatter(grads, layouts, quant=quant)
    return reduce_scatter_flat(grads, layouts)


def makes_host_copies(config: ZeroConfig) -> bool:
    """Whether backward makes host copies of the reduced gradient shards as it reduces
    them (per layer, inside a scan's backward loop too): with the host step
    (``Offload(optimizer="host")``) at stages 2-3, where every reduce-scatter happens in
    backward. Not with gradient accumulation (the host reads the sum over micro-batches),
    nor where the reduce-scatter is inside a prefetched scan or hpZ's group gather, whose
    own backward rules return the reduced shard only: there the host step copies each
    gradient after backward, as at stage 1."""
    offload, comm = config.offload, config.comm
    return (
        offload.optimizer == "host"
        and config.partitions_grads
        and config.step.grad_accum == 1
        and not (config.partitions_params and (comm.prefetch or comm.hpz is not None))
    )
