"""The optimizer step on the host (``Offload(optimizer="host")``), on 8 CPU devices.

XLA:CPU runs ``compute_on("device_host")`` on the same cores and memory as its "device",
so these tests check placement (the memory kind every leaf rests in, what the compiled
step copies between memories) and numerics: bitwise those of the same run without offload
(each bucket evaluates the very equations of the whole-tree update, and the host divides
the reduced gradient as the step does), and single-device Optax at fp32.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, awkward_batches, awkward_loss, awkward_params, reference

import jzero

HOST = "pinned_host"
BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)
FP16 = jzero.Precision(param_dtype=jnp.float16, initial_loss_scale=2.0**10)
ON_HOST = jzero.Offload(optimizer="host")
TXS = {
    "adam": optax.adam(1e-2),
    "clip_adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "adafactor": optax.adafactor(1e-2),
    # Clips Adam's *updates*: no per-leaf split, the whole update is one host bucket.
    "adam_clip": optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.5)),
}


def _kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _opt(stage, tx, offload, precision=BF16):
    return jzero.ZeroOptimizer(
        TXS[tx], jzero.data_mesh(), stage=stage, min_shard_size=1, precision=precision,
        offload=offload,
    )  # fmt: skip


@functools.cache
def _run(stage: int, tx: str, offload, precision=BF16, steps: int = 4):
    """``steps`` steps of the awkward model: the optimizer, the last state, the losses."""
    opt = _opt(stage, tx, offload, precision)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
    losses = []
    for batch in awkward_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, state, losses


def _full(opt, state):
    full = opt.full_state(state)
    return full.params, full.opt_state, full.master


@pytest.mark.parametrize(
    ("stage", "tx"),
    [(1, "adam"), (2, "adam"), (3, "adam"), (3, "clip_adamw"), (2, "adafactor"), (1, "adam_clip")],
)
def test_host_step_places_the_state_on_host_and_matches_the_device_run(stage, tx):
    opt, state, losses = _run(stage, tx, ON_HOST)
    assert state.plan.host_step and state.plan.offload == ON_HOST
    assert _kinds((state.opt_state, state.master)) == {HOST}
    assert _kinds(state.params) == {"device"}
    _, plain, plain_losses = _run(stage, tx, None)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        assert got.sharding.spec == want.sharding.spec  # the same layout, another memory
        assert got.addressable_data(0).shape == want.addressable_data(0).shape
    assert losses == plain_losses
    for got, want in zip(jax.tree.leaves(_full(opt, state)), jax.tree.leaves(_full(opt, plain))):
        np.testing.assert_array_equal(got, want)
