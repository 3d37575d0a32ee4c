"""Models and matrix optimizers for the tests of whole-matrix updates (Muon, GaLore,
Adafactor): an unrolled stack of weight matrices and the same layers scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

LAYERS, D, F = 8, 16, 32  # 8 layers of D x F and F x D: two stacks of 8 on 8 devices


def unrolled_params(layers: int = LAYERS, seed: int = 0) -> dict:
    ks = jax.random.split(jax.random.key(seed), 3 * layers)
    layer = lambda i: {
        "up": jax.random.normal(ks[i], (D, F)) / D**0.5,
        "down": jax.random.normal(ks[layers + i], (F, D)) / F**0.5,
        "b": jax.random.normal(ks[2 * layers + i], (F,)) * 0.1,
    }
    return {f"l{i}": layer(i) for i in range(layers)}


def unrolled_loss(params, batch):
    h_BxD = batch["x"]
    for i in range(len(params)):
        p = params[f"l{i}"]
        h_BxD = h_BxD + jnp.tanh(h_BxD @ p["up"] + p["b"]) @ p["down"]
    return jnp.mean((h_BxD - batch["y"]) ** 2)


def scanned_params(layers: int = LAYERS, seed: int = 0) -> dict:
    """The same layers stacked for ``lax.scan`` (leading axis: layers)."""
    p = unrolled_params(layers, seed)
    return {k: jnp.stack([p[f"l{i}"][k] for i in range(layers)]) for k in ("up", "down", "b")}


def scanned_loss(params, batch):
    def layer(h_BxD, p):
        return h_BxD + jnp.tanh(h_BxD @ p["up"] + p["b"]) @ p["down"], None

    h_BxD, _ = jax.lax.scan(layer, batch["x"], params)
    return jnp.mean((h_BxD - batch["y"]) ** 2)


def batches(steps: int, batch_size: int = 16) -> list[dict]:
    keys = jax.random.split(jax.random.key(5), steps)
    x = lambda k: jax.random.normal(k, (batch_size, D))
    return [{"x": x(k), "y": jnp.sin(x(k) * 2)} for k in keys]


STACK_DIMS = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
SCANNED_DIMS = {"up": STACK_DIMS, "down": STACK_DIMS, "b": None}


def _is_matrix(params):
    return jax.tree.map(lambda x: x.ndim == 2, params)


OPTIMIZERS = {  # name -> (make, scanned model?)
    "muon": (lambda: optax.contrib.muon(1e-2), False),
    "muon_options": (
        lambda: optax.contrib.muon(
            1e-2,
            nesterov=False,
            adaptive=True,
            consistent_rms=0.2,
            weight_decay=0.1,
            weight_decay_mask=_is_matrix,
        ),
        False,
    ),
    "muon_scanned": (
        lambda: optax.contrib.muon(1e-2, muon_weight_dimension_numbers=SCANNED_DIMS),
        True,
    ),
    "clip_muon": (
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.contrib.muon(1e-2)),
        False,
    ),
    "adafactor": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4), False),
    "galore": (lambda: optax.contrib.galore(1e-2, rank=4), False),
}


def model(scanned: bool) -> tuple:
    """``(params, loss)`` of the scanned or the unrolled model."""
    return (scanned_params(), scanned_loss) if scanned else (unrolled_params(), unrolled_loss)


MODEL_SPECS = {  # a matrix axis of each weight over 'model', as tensor parallelism splits it
    False: lambda p: {k: {"up": P(None, "model"), "down": P("model"), "b": P()} for k in p},
    True: lambda p: {"up": P(None, None, "model"), "down": P(None, "model"), "b": P()},
}
