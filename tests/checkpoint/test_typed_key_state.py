"""A typed PRNG key in the Optax state (``optax.noisy_sgd``) round-trips bitwise: saved as
its raw uint32 data, typed again on restore, at another stage too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import jzero


@pytest.mark.parametrize("saved_stage, restored_stage", [(2, 2), (1, 3)])
def test_a_typed_key_in_the_optax_state_round_trips(tmp_path, saved_stage, restored_stage):
    mesh = jzero.data_mesh()
    make = lambda stage: jzero.ZeroOptimizer(
        optax.noisy_sgd(0.1, key=jax.random.key(3)), mesh, stage=stage
    )
    params = {"w": jnp.linspace(0.0, 1.0, 128).reshape(16, 8)}
    opt = make(saved_stage)
    state = opt.init(params)
    state, _ = opt.train_step(lambda p, b: jnp.sum(p["w"] ** 2))(state, {"x": jnp.zeros((8,))})
    with jzero.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        restored = ckpt.restore(make(restored_stage), params, step=1).state
    key, want = restored.opt_state[0].rng_key, state.opt_state[0].rng_key
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert jnp.array_equal(jax.random.key_data(key), jax.random.key_data(want))
    assert jnp.array_equal(restored.params["w"], state.params["w"])
