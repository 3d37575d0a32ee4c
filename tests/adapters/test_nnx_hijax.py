"""``jzero.nnx.Optimizer`` on Flax's hijax Variables (``nnx.var_defaults(hijax=True)``):
Variables that are JAX values themselves, not pytrees of arrays. The same model and steps
as ``nnx.Optimizer``'s, eager (Flax 0.12's own hijax examples do not run under ``jax.jit``
on this JAX: "DynamicJaxprTracer has no attribute mutable"), at stages 1-3; fp32 parity to
rtol 1e-6, as ``tests/optimizers/user_step/test_user_step_parity.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero

X = jnp.linspace(-1.0, 1.0, 128).reshape(8, 16)


def _loss(model):
    return jnp.mean((model(X) - 1.0) ** 2)


def _trained(make_optimizer, *, split: bool):
    with nnx.var_defaults(hijax=True):
        model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
        optimizer = make_optimizer(model)
        for _ in range(3):
            if split:  # the functional form: grads of the Param state, read as arrays
                graphdef, params, rest = nnx.split(model, nnx.Param, ...)
                loss = lambda p, g=graphdef, r=rest: _loss(nnx.merge(g, p, r))
                grads = jax.grad(loss)(nnx.with_vars(params, hijax=False))
            else:
                grads = nnx.grad(_loss)(model)
            optimizer.update(model, grads)
    return model


@pytest.mark.parametrize("split", [False, True], ids=["nnx.grad", "split"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hijax_variables_train_as_with_nnx_optimizer(stage, split):
    mesh = jzero.data_mesh()
    want = _trained(lambda m: nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param), split=split)
    got = _trained(
        lambda m: jzero.nnx.Optimizer(
            m, optax.adamw(1e-2), wrt=nnx.Param, mesh=mesh, stage=stage, min_shard_size=1
        ),
        split=split,
    )
    assert type(got.kernel).__name__ == "HijaxVariable"
    for g, w in ((got.kernel, want.kernel), (got.bias, want.bias)):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(w[...]), rtol=1e-6, atol=1e-6)
    spec = got.kernel[...].sharding.spec
    assert spec == (jax.P(None, "data") if stage == 3 else jax.P())
