"""Every stage x optimizer gives plain single-device Optax's numbers."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _models import (
    OPTIMIZERS,
    SHAPES,
    assert_each_step_is_optax,
    awkward_batches,
    awkward_loss,
    awkward_params,
    record,
    reference,
    stacked_batch,
    stacked_loss,
    stacked_params,
)

import jzero

# fp32: parameters and optimizer state agree to float rounding. The distributed step sums
# the gradient in a different order (per-device partial sums, then a psum or
# reduce-scatter), so elements differ by a few ulps; near-zero elements get absolute error
# of the same size, hence atol as well as rtol. The oracle test bounds each step from the
# same state (_models.assert_each_step_is_optax); the others compare a few steps' ends.
RTOL, ATOL = 1e-6, 1e-6
STEPS = 5


def _run(stage, tx, params, batches, **kw):
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage, **kw)
    state = opt.init(params)
    step = opt.train_step(awkward_loss)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return opt, state, losses


@pytest.mark.every_case  # the oracle: every optimizer at every stage, in CI too
@pytest.mark.parametrize(
    ("stage", "name"),
    [
        pytest.param(s, n, marks=[pytest.mark.smoke] if (s, n) == (3, "adamw") else [])
        for s in (0, 1, 2, 3)
        for n in sorted(OPTIMIZERS)
    ],
)
def test_matches_single_device_optax(stage, name):
    # min_shard_size=1: every non-scalar leaf is sharded, padded where needed.
    opt = jzero.ZeroOptimizer(OPTIMIZERS[name](), jzero.data_mesh(), stage=stage, min_shard_size=1)
    train_step = opt.train_step(awkward_loss)

    def step(state, batch):
        state, metrics = train_step(state, batch)
        return state, metrics["loss"]

    whole = lambda state: (opt.full_params(state), opt.full_state(state).opt_state)
    batches = awkward_batches(STEPS)
    _, trajectory = record(step, opt.init(awkward_params()), whole, batches)
    assert_each_step_is_optax(OPTIMIZERS[name](), awkward_loss, trajectory, batches)


@pytest.mark.parametrize("stage", [1, 3])
def test_padding_stays_zero(stage):
    params, batches = awkward_params(), awkward_batches(3)
    opt, state, _ = _run(
        stage, optax.adamw(1e-2, weight_decay=0.1), params, batches, min_shard_size=1
    )
    trees = [state.opt_state] + ([state.params] if stage == 3 else [])
    lays = [state.plan.opt_tree()] + ([state.plan.params_tree()] if stage == 3 else [])
    checked = 0
    for tree, lay_tree in zip(trees, lays):
        for x, lay in zip(
            jax.tree.leaves(tree),
            jax.tree.leaves(lay_tree, is_leaf=jzero.LeafLayout.__instancecheck__),
        ):
            if lay.pad:
                tail = np.take(
                    np.asarray(x), range(lay.shape[lay.dim], lay.padded[lay.dim]), axis=lay.dim
                )
                assert not tail.any()
                checked += 1
    assert checked >= 4


def test_threshold_keeps_small_leaves_replicated():
    params, batches = awkward_params(), awkward_batches(STEPS)
    ref_params, _, _, _ = reference(optax.adam(1e-2), params, awkward_loss, batches)
    opt, state, _ = _run(3, optax.adam(1e-2), params, batches, min_shard_size=100)
    sharded = {k for k, lay in zip(sorted(params), state.plan.layouts) if lay.sharded}
    assert sharded == {"emb"}  # 520 elements; the rest have fewer than 100
    got = opt.full_params(state)
    for k in ref_params:
        np.testing.assert_allclose(got[k], ref_params[k], rtol=RTOL, atol=ATOL)


def test_default_shards_every_leaf_but_scalars():
    state = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3).init(awkward_params())
    sharded = {k: lay.sharded for k, lay in zip(sorted(SHAPES), state.plan.layouts)}
    assert sharded == {k: k != "s" for k in SHAPES}


@pytest.mark.parametrize("pipeline_scatter", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_scanned_layers_with_a_width_that_does_not_divide(stage, pipeline_scatter):
    # (8, 100) biases: only the stacked-layers axis divides 8, yet it must stay whole for
    # the per-layer gather inside lax.scan; the width is padded instead. pipeline_scatter
    # (XLA:GPU's reduce-scatter pipeliner kept) places the collectives, not the values.
    params = stacked_params(layers=8, width=100)
    batches = [stacked_batch(width=100)] * 3
    # eps well above the gradients' rounding noise: with eps=1e-8, Adam turns a few ulps
    # of summation-order noise on near-zero gradient elements into +-lr steps.
    tx = lambda: optax.adam(1e-2, eps=1e-3)
    ref_params, _, ref_losses, _ = reference(tx(), params, stacked_loss, batches)
    comm = jzero.Communication(pipeline_scatter=pipeline_scatter)
    opt = jzero.ZeroOptimizer(tx(), jzero.data_mesh(), stage=stage, min_shard_size=1, comm=comm)
    state = opt.init(params)
    assert [lay.dim for lay in state.plan.layouts] == [1, 2]
    step = opt.train_step(stacked_loss, manual_gather=True)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
