"""What the offload tests share: the host memory kind, the Optax transformations they run
(elementwise, clipped, factored, and one whose update does not split per leaf), and the
memory kinds a tree's leaves rest in."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import assert_tree_close

import jzero

HOST = "pinned_host"
TXS = {
    "adam": optax.adam(1e-2),
    "clip_adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "adafactor": optax.adafactor(1e-2),
    # Clips Adam's *updates*: the norm reads every leaf's moments, so no per-leaf split.
    "adam_clip": optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.5)),
}


def memory_kinds(tree) -> set[str]:
    """The memory kinds of ``tree``'s (array) leaves."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def full_parts(opt, state):
    full = opt.full_state(state)
    return full.params, full.opt_state, full.master


FP16 = jzero.Precision(param_dtype=jnp.float16, initial_loss_scale=2.0**10)


def assert_overflow_skipped_as_without_offload(
    make_opt, params, loss_fn, batches, offloaded: Any = "optimizer"
) -> None:
    """Batches (good, overflowing, good) at fp16: the offloaded optimizer
    (``make_opt(offload)``) skips the same step and ends bitwise where the other one does."""
    finals, skipped = [], []
    for offload in (None, offloaded):
        opt = make_opt(offload)
        state, step = opt.init(params), opt.train_step(loss_fn)
        history = []
        for batch in batches:
            state, metrics = step(state, batch)
            history.append(int(metrics["skipped"]))
        finals.append(full_parts(opt, state))
        skipped.append(history)
    assert skipped == [[0, 1, 0], [0, 1, 0]]
    for got, want in zip(jax.tree.leaves(finals[1]), jax.tree.leaves(finals[0])):
        np.testing.assert_array_equal(got, want)


def assert_as_without_offload(opt, state, losses, plain, plain_losses) -> None:
    """An offloaded run (``state``, ``losses``) is the run without offload (``plain``,
    ``plain_losses``) in another memory: the same layout, losses and parts, bitwise."""
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        assert got.sharding.spec == want.sharding.spec  # the same layout, another memory
        assert got.addressable_data(0).shape == want.addressable_data(0).shape
    assert losses == plain_losses
    for got, want in zip(
        jax.tree.leaves(full_parts(opt, state)), jax.tree.leaves(full_parts(opt, plain))
    ):
        np.testing.assert_array_equal(got, want)


def assert_as_reference(opt, state, losses, ref) -> None:
    """An fp32 offloaded run agrees with single-device Optax (``ref``) to rounding: its
    losses, parameters and Optax state."""
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6)
    params, opt_state, _ = full_parts(opt, state)
    assert_tree_close(params, ref.params, rtol=1e-6, atol=1e-6)
    assert_tree_close(opt_state, ref.opt_state, rtol=1e-6, atol=1e-6)


HOST_BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)


def offload_opt(stage: int, tx: str, offload, precision=HOST_BF16) -> jzero.ZeroOptimizer:
    """``TXS[tx]`` at ``stage`` on every device, every leaf sharded, with ``offload``."""
    return jzero.ZeroOptimizer(
        TXS[tx], jzero.data_mesh(), stage=stage, min_shard_size=1, precision=precision,
        offload=offload,
    )  # fmt: skip


@functools.cache
def run_awkward(stage: int, tx: str, offload, precision=HOST_BF16, steps: int = 4):
    """``steps`` steps of the awkward model: the optimizer, the last state, the losses."""
    from _models import awkward_batches, awkward_loss, awkward_params

    opt = offload_opt(stage, tx, offload, precision)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
    losses = []
    for batch in awkward_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, state, losses
