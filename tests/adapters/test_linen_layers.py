"""``jzero.linen.TrainState.create(..., layers=Block)``: per-layer gathering of an unrolled
Linen model with no edit to the model (FSDP's wrapping policy, as one argument)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo_text import assert_gathered_per_layer
from _models import assert_tree_close, make_tx, random_pairs, reference

import jzero

IN, D, H, OUT, LAYERS, BATCH, STEPS = 32, 64, 256, 16, 6, 64, 3
# Adam eps above the gradients' fp32 rounding noise (sums in another order on 8 devices),
# so that Adam does not turn that noise into +-lr updates (docs/design.md, "Traps").
EPS = 1e-4


class Block(nn.Module):
    """Dense D->H->D with a residual: the layer gathered on its own."""

    @nn.compact
    def __call__(self, x_BxD):
        h_BxH = nn.gelu(nn.Dense(H)(x_BxD))
        return x_BxD + nn.Dense(D)(h_BxH)


class Model(nn.Module):
    """An input Dense, ``LAYERS`` unrolled blocks and an output Dense (gathered once)."""

    @nn.compact
    def __call__(self, x_BxI):
        x_BxD = nn.Dense(D)(x_BxI)
        for _ in range(LAYERS):  # a plain Python loop: no nn.scan, no nn.remat
            x_BxD = Block()(x_BxD)
        return nn.Dense(OUT)(x_BxD)


model = Model()


def loss_fn(params, batch):
    out_BxO = model.apply({"params": params}, batch["x"])
    return jnp.mean((out_BxO - batch["y"]) ** 2)


def make_batches(n):
    return random_pairs(n, BATCH, IN, OUT, seed=5)


def init_variables():
    return model.init(jax.random.key(0), jnp.zeros((BATCH, IN), jnp.float32))


def make_state(stage, **kwargs):
    return jzero.linen.TrainState.create(
        apply_fn=model.apply,
        variables=init_variables(),
        tx=make_tx(1e-3, eps=EPS),
        mesh=jzero.data_mesh(),
        stage=stage,
        **kwargs,
    )


def compiled_stage3(**kwargs):
    state = make_state(3, **kwargs)
    return state.train_step(loss_fn).lower(state, make_batches(1)[0]).compile()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layers_matches_single_device_optax(stage):
    batches = make_batches(STEPS)
    ref = reference(make_tx(1e-3, eps=EPS), init_variables()["params"], loss_fn, batches)
    state = make_state(stage, layers=Block)
    step = state.train_step(loss_fn)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5, atol=1e-6)
    assert_tree_close(state.params, ref.params, rtol=1e-5, atol=1e-6)


def test_stage3_layers_gather_each_block_twice_and_lower_temp():
    assert_gathered_per_layer(
        compiled_stage3(layers=Block), compiled_stage3(),
        blocks=[(D, H), (H, D)], others=[(IN, D), (D, OUT)], layers=LAYERS,
    )  # fmt: skip


@pytest.mark.parametrize("bad", [Block(), "Block", jnp.tanh, (Block, 3), int])
def test_layers_rejects_non_module_classes(bad):
    with pytest.raises(TypeError, match="layers= takes a flax.linen Module class"):
        make_state(3, layers=bad)


def test_layers_that_loss_never_calls_is_an_error():
    state = make_state(3, layers=nn.LayerNorm)  # a Module class the model never uses
    with pytest.raises(ValueError, match="calls no instance of LayerNorm"):
        state.train_step(loss_fn).lower(state, make_batches(1)[0])
