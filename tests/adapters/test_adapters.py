"""The Flax adapters at parity with the core: the same options (precision, min_shard_size,
param_specs, has_aux, donate), the same step (jitted core, consumed states refused), and the
same numbers as ``ZeroOptimizer`` on the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_models import (
    NNXMLP,
    D,
    batch,
    linen_loss,
    linen_state,
    nnx_loss,
    nnx_state,
)
from flax import nnx

import jzero

BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def core_run(params, loss, stage, precision, steps=2, offload=None):
    opt = jzero.ZeroOptimizer(
        optax.adam(1e-2), jzero.data_mesh(), stage=stage, precision=precision, offload=offload
    )
    state, step = opt.init(params), opt.train_step(loss, has_aux=True)
    for i in range(steps):
        state, metrics = step(state, batch(i))
    return opt.full_state(state), metrics


HOST_STEP = jzero.Offload(optimizer="host")


@pytest.mark.parametrize(
    ("stage", "precision", "offload"),
    [(1, None, None), (1, BF16, None), (3, None, None), (3, BF16, None), (3, BF16, HOST_STEP)],
)
def test_linen_equals_core(stage, precision, offload):
    state, params = linen_state(stage, precision=precision, offload=offload)
    step = state.train_step(linen_loss, has_aux=True)
    for i in range(2):
        state, metrics = step(state, batch(i))
    want, want_metrics = core_run(params, linen_loss, stage, precision, offload=offload)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.zero.opt_state)}
    assert kinds == ({"pinned_host"} if offload else {"device"})
    assert (state.zero.master is not None) == (precision is not None)
    got = state.opt.full_state(state.zero)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)  # the same program: bit for bit
    np.testing.assert_array_equal(metrics["aux"]["mse"], want_metrics["aux"]["mse"])


@pytest.mark.parametrize(
    ("stage", "precision", "offload"),
    [(1, None, None), (1, BF16, None), (3, None, None), (3, BF16, None), (3, BF16, HOST_STEP)],
)
def test_nnx_equals_core(stage, precision, offload):
    state, params = nnx_state(stage, precision=precision, offload=offload)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.zero.opt_state)}
    assert kinds == ({"pinned_host"} if offload else {"device"})
    step = state.train_step(nnx_loss, has_aux=True)
    for i in range(2):
        state, metrics = step(state, batch(i))
    graphdef, _, rest = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, batch):
        return nnx_loss(nnx.merge(graphdef, params, rest), batch)

    want, want_metrics = core_run(params, loss, stage, precision, offload=offload)
    assert (state.zero.master is not None) == (precision is not None)
    got = state.opt.full_state(state.zero)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(metrics["aux"]["mse"], want_metrics["aux"]["mse"])


@pytest.mark.parametrize("make", [linen_state, nnx_state])
def test_min_shard_size_default_and_passed_through(make):
    state, _ = make(3)
    assert state.opt.min_shard_size == jzero.Layout().min_shard_size
    state, _ = make(3, min_shard_size=64)  # the biases (16, 32 elements) stay replicated
    assert state.opt.min_shard_size == 64
    sharded = {lay.shape: lay.sharded for lay in state.zero.plan.layouts}
    assert sharded == {(D,): False, (2 * D,): False, (D, 2 * D): True, (2 * D, D): True}


@pytest.mark.parametrize("make, loss", [(linen_state, linen_loss), (nnx_state, nnx_loss)])
def test_both_steps_refuse_a_consumed_state_and_lower(make, loss):
    state, _ = make(2)
    step = state.train_step(loss, has_aux=True)
    assert type(step) is jzero.adapters.shared.AdapterStep
    hlo = step.lower(state, batch()).compile().as_text()
    assert "reduce-scatter" in hlo
    new, _ = step(state, batch())
    with pytest.raises(ValueError, match="consumed by"):
        step(state, batch())
    kept = new.train_step(loss, has_aux=True, donate=False)
    kept(new, batch())
    kept(new, batch())  # donate=False: the same state twice


def test_nnx_param_specs_argument():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {"up": {"kernel": jax.P(None, "model"), "bias": jax.P("model")}, "down": None}
    state = jzero.nnx.TrainState.create(
        NNXMLP(nnx.Rngs(0)), tx=optax.sgd(0.1), mesh=mesh, stage=3, param_specs=specs
    )
    assert state.zero.params["up"]["kernel"].sharding.spec == jax.P("data", "model")
    assert state.zero.params["down"]["kernel"].sharding.spec == jax.P(None, "data")


def test_linen_params_are_gathered_once_per_state():
    state, _ = linen_state(3)
    first = state.params
    assert state.params is first  # no new gather on each access
    assert first["Dense_0"]["kernel"].shape == (2 * D, D)
    step = state.train_step(linen_loss, has_aux=True, donate=False)
    new, _ = step(state, batch())
    assert new.params is not first
    assert not np.array_equal(new.params["Dense_0"]["kernel"], first["Dense_0"]["kernel"])
