"""Non-trainable model state (e.g. batch statistics) stays identical on every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_params

import jzero


def loss_with_stats(params, model_state, batch):
    params = jzero.gather(params)
    mean_E = jnp.mean(batch["x"], axis=0)
    new_state = {
        "mean": 0.9 * model_state["mean"] + 0.1 * mean_E,
        "count": model_state["count"] + 1,
    }
    x_BxE = (batch["x"] - model_state["mean"]) @ params["emb"]
    h_Bx7 = jnp.tanh(x_BxE @ params["w1"] + params["b1"])
    y_Bx5 = (h_Bx7 @ params["w2"]) * params["s"] + params["b2"]
    return jnp.mean((y_Bx5 - batch["y"]) ** 2), new_state


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_batch_statistics_match_single_device_and_agree_across_devices(stage, grad_accum):
    params, batches = awkward_params(), awkward_batches(3)
    model_state = {"mean": jnp.zeros((40,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    tx = optax.adam(1e-2)

    # Oracle: one device, the whole batch (the statistics of the global batch).
    ref_p, ref_ms, ref_opt = params, model_state, tx.init(params)
    for batch in batches:
        (_, new_ms), g = jax.value_and_grad(loss_with_stats, has_aux=True)(ref_p, ref_ms, batch)
        u, ref_opt = tx.update(g, ref_opt, ref_p)
        ref_p, ref_ms = optax.apply_updates(ref_p, u), new_ms

    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage, min_shard_size=1)
    state = opt.init(params, model_state=model_state)
    step = opt.train_step(loss_with_stats, with_model_state=True, grad_accum=grad_accum)
    for batch in batches:
        state, _ = step(state, batch)

    mean = state.model_state["mean"]
    shards = [np.asarray(s.data) for s in mean.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])  # identical on every device
    if grad_accum == 1:
        np.testing.assert_allclose(mean, ref_ms["mean"], rtol=1e-6, atol=1e-7)
        for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref_p)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # With k micro-batches the statistics update k times per step, as k sequential
    # steps of a framework like DeepSpeed would.
    assert int(state.model_state["count"]) == 3 * grad_accum


def test_model_state_must_be_arrays():
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=1)
    with pytest.raises(TypeError, match=r"model_state leaf \['momentum'\]"):
        opt.init(awkward_params(), model_state={"momentum": "fast"})


def test_init_copies_the_callers_model_state():
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=1)
    model_state = {"mean": jnp.zeros((40,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    state = opt.init(awkward_params(), model_state=model_state)
    step = opt.train_step(loss_with_stats, with_model_state=True)
    state, _ = step(state, awkward_batches(1)[0])  # donates the state's buffers
    assert float(model_state["mean"].sum()) == 0.0  # the caller's arrays are still alive
