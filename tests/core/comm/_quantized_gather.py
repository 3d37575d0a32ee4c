"""What the int8 and fp8 gather tests share: the leaf shapes a gather is checked on, the
three ways of gathering them (exact of each round-tripped shard, alone, bucketed), the
parameters as a quantized stage-3 gather delivers them, and the first-order bound's sum."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import collectives
from jzero.core.comm.collectives import all_gather
from jzero.core.comm.quantize import quantized_all_gather
from jzero.core.leaf_layout import LeafLayout
from jzero.core.options.communication import Quant

SHAPES = [(16, 24), (24,), (5, 3), (7,), (4, 9, 16), (3, 300)]  # padded, dims 0/1/2, >1 block


def check_gathers(lays: list[LeafLayout], quant: Quant, roundtrip: Callable) -> set[str]:
    """Each leaf gathered alone and in a bucket equals the exact gather of every device's
    shard round-tripped by ``roundtrip(flat, block)[0]``; the all-gathers' dtypes."""
    keys = jax.random.split(jax.random.key(1), len(lays))
    shards = [jax.random.normal(k, lay.padded) for k, lay in zip(keys, lays)]

    def body(shards):
        exact = []
        for x, lay in zip(shards, lays):
            moved = jnp.moveaxis(x, lay.axis(x), 0)
            x_hat = roundtrip(moved.reshape(-1), quant.block)[0].reshape(moved.shape)
            exact.append(all_gather(jnp.moveaxis(x_hat, 0, lay.axis(x)), lay))
        alone = [quantized_all_gather([x], [lay], quant=quant)[0] for x, lay in zip(shards, lays)]
        return exact, alone, quantized_all_gather(shards, lays, quant=quant)

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=jzero.data_mesh(),
            in_specs=([lay.data_spec() for lay in lays],),
            out_specs=([P()] * len(lays),) * 3,
            check_vma=False,
        )
    )
    for exact, alone, bucketed, lay in zip(*run(shards), lays):
        assert alone.shape == lay.shape
        np.testing.assert_array_equal(alone, exact)
        np.testing.assert_array_equal(bucketed, exact)
    colls = collectives(run.lower(shards).compile().as_text())
    return {c.dtype for c in colls if c.kind == "all-gather"}


def dequantized(state: jzero.ZeroState, quant: Quant, *, per_layer: Callable[[str], bool]) -> dict:
    """The parameters as a quantized stage-3 gather delivers them: each device's shard
    round-tripped (a stacked leaf, ``per_layer(its key path)``, one layer at a time, as
    stage 3 gathers it in a scan)."""
    plan = state.plan
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]

    def body(leaves):
        out = []
        for x, lay, path in zip(leaves, plan.layouts, paths, strict=True):
            one = lambda s, lay=lay: quantized_all_gather([s], [lay], quant=quant)[0]
            if not lay.sharded:
                out.append(x)
            elif per_layer(path):
                out.append(jnp.stack([one(x[i]) for i in range(x.shape[0])]))
            else:
                out.append(one(x))
        return out

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=plan.mesh,
            in_specs=([lay.data_spec() for lay in plan.layouts],),
            out_specs=[P()] * len(plan.layouts),
            check_vma=False,
        )
    )
    return jax.tree.unflatten(plan.params_def, run(jax.tree.leaves(state.params)))


def abs_dot(a: dict, b: dict) -> float:
    """sum |a| * |b| over every element of two trees."""
    return float(sum(np.sum(np.abs(x) * np.abs(y)) for x, y in zip(*map(jax.tree.leaves, (a, b)))))
