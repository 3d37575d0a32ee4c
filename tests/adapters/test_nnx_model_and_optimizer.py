"""``jzero.nnx.ModelAndOptimizer`` steps as Flax's (deprecated, still shipped)
``nnx.ModelAndOptimizer``: ``update(grads)`` with the model held; fp32 parity to rtol 1e-6
at stages 1-3, as ``tests/optimizers/user_step/test_user_step_parity.py``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero

X = jnp.linspace(-1.0, 1.0, 128).reshape(8, 16)


def _trained(make):
    state = make(nnx.Linear(16, 32, rngs=nnx.Rngs(0)))

    @nnx.jit
    def step(state):
        state.update(nnx.grad(lambda m: jnp.mean((m(X) - 1.0) ** 2))(state.model))

    for _ in range(3):
        step(state)
    return state.model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_and_optimizer_updates_its_own_model(stage):
    mesh = jzero.data_mesh()
    want = _trained(lambda m: nnx.ModelAndOptimizer(m, optax.adam(1e-2)))
    got = _trained(
        lambda m: jzero.nnx.ModelAndOptimizer(
            m, optax.adam(1e-2), mesh=mesh, stage=stage, min_shard_size=1
        )
    )
    for g, w in ((got.kernel, want.kernel), (got.bias, want.bias)):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(w[...]), rtol=1e-6, atol=1e-6)
