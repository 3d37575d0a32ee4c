"""Small Flax Linen and NNX models, their losses and train states, as the adapter tests and
the option tests build them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jzero

D, BATCH = 16, 16


def batch(seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (BATCH, D)), "y": jax.random.normal(ky, (BATCH, D))}


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(jnp.tanh(nn.Dense(2 * D)(x)))


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


def linen_loss(params, batch):
    pred = LinenMLP().apply({"params": params}, batch["x"].astype(jax.tree.leaves(params)[0].dtype))
    mse = jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)
    return mse, {"mse": mse}


def nnx_loss(model, batch):
    pred = model(batch["x"].astype(model.up.kernel[...].dtype))
    mse = jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)
    return mse, {"mse": mse}


def linen_state(stage, **kw):
    variables = LinenMLP().init(jax.random.key(0), jnp.zeros((1, D)))
    return jzero.linen.TrainState.create(
        apply_fn=LinenMLP().apply,
        variables=variables,
        tx=optax.adam(1e-2),
        mesh=jzero.data_mesh(),
        stage=stage,
        **kw,
    ), variables["params"]


def nnx_state(stage, **kw):
    model = NNXMLP(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = jzero.nnx.TrainState.create(
        model, tx=optax.adam(1e-2), mesh=jzero.data_mesh(), stage=stage, **kw
    )
    return state, params
