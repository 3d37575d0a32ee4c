"""Small models and a single-device Optax oracle shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero

# Awkward shapes on 8 devices: primes (13x7, 7x5), vectors shorter than the device count,
# a scalar, and one leaf that divides evenly.
SHAPES = {"emb": (40, 13), "w1": (13, 7), "b1": (7,), "w2": (7, 5), "b2": (5,), "s": ()}


def awkward_params(seed: int = 0) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    params = {
        name: jax.random.normal(k, shape, jnp.float32) * 0.5
        for k, (name, shape) in zip(keys, SHAPES.items())
    }
    params["s"] = jnp.asarray(1.5, jnp.float32)
    return params


def awkward_loss(params, batch):
    params = jzero.gather(params)
    x_BxE = batch["x"] @ params["emb"]
    h_Bx7 = jnp.tanh(x_BxE @ params["w1"] + params["b1"])
    y_Bx5 = (h_Bx7 @ params["w2"]) * params["s"] + params["b2"]
    return jnp.mean((y_Bx5 - batch["y"]) ** 2)


def awkward_batches(steps: int, batch_size: int = 16, seed: int = 1) -> list[dict[str, jax.Array]]:
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(seed * 1000 + i))
        out.append(
            {
                "x": jax.random.normal(kx, (batch_size, 40), jnp.float32),
                "y": jax.random.normal(ky, (batch_size, 5), jnp.float32),
            }
        )
    return out


def stacked_params(layers: int = 4, width: int = 64, seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "layers": {
            "w": jax.random.normal(k1, (layers, width, width), jnp.float32) / np.sqrt(width),
            "b": jax.random.normal(k2, (layers, width), jnp.float32) * 0.1,
        }
    }


def stacked_loss(params, batch):
    """A scanned, rematerialised stack of tanh layers; each layer gathers its parameters."""

    @jax.checkpoint
    def layer(x_BxD, p):
        p = jzero.gather(p)
        return jnp.tanh(x_BxD @ p["w"] + p["b"]), None

    x_BxD, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def stacked_batch(width: int = 64, batch_size: int = 16) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(7))
    return {
        "x": jax.random.normal(kx, (batch_size, width), jnp.float32),
        "y": jax.random.normal(ky, (batch_size, width), jnp.float32),
    }


def reference(tx: optax.GradientTransformation, params, loss_fn, batches):
    """Plain single-device Optax: the oracle."""
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(loss)
    return params, opt_state, losses
