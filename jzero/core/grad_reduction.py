"""Gradients, model state and aux reduced over the devices of a data-parallel step.

Gradients: summed over the data group (all-reduced, or reduce-scattered to this device's
shard), then, when hybrid, all-reduced across 'replica'. Model state and aux: one value on
every device (means of floats; max or sum of integers; PRNG keys never averaged).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import rng
from .comm.reducer import Reducer
from .leaf_layout import LeafLayout
from .mesh import DATA, REPLICA
from .plan import Plan


class Gradients(NamedTuple):
    """The step's reduced gradients, in the forms the updaters read (:mod:`.updaters`)."""

    reduced: Any  # as reduced: stored (padded) shards, reduce dtype, device memory
    denominator: jax.Array  # scalar the reduced sums are divided by (devices x micro-batches)
    averaged: Any  # reduced / denominator, fp32, true shapes, device memory
    host_copies: tuple | None = None  # per leaf, ``reduced``'s host copy made in backward
    # (:meth:`.Reducer.host_copied`), or None (the host step copies that leaf after backward)

    def host_reads(self) -> list:
        """Per parameter leaf, what the host reads of its reduced gradient: the host copy
        backward made, else the reduced shard on the device."""
        reduced = jax.tree.leaves(self.reduced)
        copies = self.host_copies or (None,) * len(reduced)
        return [g if c is None else c for g, c in zip(reduced, copies)]


def agree(x: jax.Array, axes) -> jax.Array:
    """One value of a model-state leaf on every device: the mean of floats (e.g. batch
    statistics, as synchronised batch norm would give), the max of integers (counters);
    PRNG keys are never averaged (:func:`.rng.agree`: device 0's where they differ)."""
    if rng.is_key(x):
        return rng.agree(x, axes)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.pmax(x, axes)


def combine_micro(x: jax.Array) -> jax.Array:
    """Aux over micro-batches (leading axis): the mean of floats, the sum of integers."""
    return x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x.sum(0)


def agree_aux(x: jax.Array, axes) -> jax.Array:
    """Aux over devices: the mean of floats (per-batch metrics), the sum of integers (counts)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.psum(x, axes)


def reduce(plan: Plan, g: jax.Array, lay: LeafLayout, reducer: Reducer) -> jax.Array:
    """Sum over the data group (all-reduce, or this device's shard reduce-scattered by
    ``reducer``), then, when hybrid, across replicas: an all-reduce of what the data group
    left on the device."""
    if not lay.sharded:
        g = jax.lax.psum(g, DATA)  # stage 0, and small replicated leaves
    elif not plan.config.partitions_grads:
        g = reducer.scatter([g], [lay])[0]  # P_os: once, after backward
    # stages 2/3: reduce-scattered already, inside backward
    if plan.hybrid:
        g = jax.lax.psum(g, REPLICA)
    return g
