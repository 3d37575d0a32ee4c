"""``jzero.nnx.TrainState.create(model, ..., layers=Block)``: per-layer gathering of an
unrolled NNX model with no edit to the model (FSDP's wrapping policy, as one argument)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo_text import assert_gathered_per_layer
from _models import make_tx, random_pairs, reference
from flax import nnx

import jzero

IN, D, H, OUT, LAYERS, BATCH, STEPS = 32, 64, 256, 16, 6, 64, 3
# Adam eps above the gradients' fp32 rounding noise (sums in another order on 8 devices).
EPS = 1e-4


class Block(nnx.Module):
    """Linear D->H->D with a residual: the layer gathered on its own."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x_BxD):
        return x_BxD + self.down(nnx.gelu(self.up(x_BxD)))


class Model(nnx.Module):
    """An input Linear, ``LAYERS`` unrolled blocks and an output Linear (gathered once)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(IN, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, x_BxI):
        x_BxD = self.embed(x_BxI)
        for block in self.blocks:  # a plain Python loop: no nnx.scan, no nnx.remat
            x_BxD = block(x_BxD)
        return self.head(x_BxD)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batches(n):
    return random_pairs(n, BATCH, IN, OUT, seed=5)


def make_state(stage, **kwargs):
    return jzero.nnx.TrainState.create(
        Model(nnx.Rngs(0)),
        tx=make_tx(1e-3, eps=EPS),
        mesh=jzero.data_mesh(),
        stage=stage,
        **kwargs,
    )


@functools.cache
def plain_reference():
    graphdef, params = nnx.split(Model(nnx.Rngs(0)))
    loss = lambda params, batch: loss_fn(nnx.merge(graphdef, params), batch)
    params, _, losses, _ = reference(make_tx(1e-3, eps=EPS), params, loss, make_batches(STEPS))
    return params, losses


def compiled_stage3(**kwargs):
    state = make_state(3, **kwargs)
    return state.train_step(loss_fn).lower(state, make_batches(1)[0]).compile()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layers_matches_single_device_optax(stage):
    ref_params, ref_losses = plain_reference()
    state = make_state(stage, layers=Block)
    step, losses = state.train_step(loss_fn), []
    for batch in make_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    params = nnx.state(state.model(), nnx.Param)
    want_leaves = jax.tree_util.tree_leaves_with_path(ref_params)
    assert len(want_leaves) == len(jax.tree.leaves(params))
    for (path, want), got in zip(want_leaves, jax.tree.leaves(params)):
        assert got.shape == want.shape, path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_stage3_layers_gather_each_block_twice_and_lower_temp():
    assert_gathered_per_layer(
        compiled_stage3(layers=Block), compiled_stage3(),
        blocks=[(D, H), (H, D)], others=[(IN, D), (D, OUT)], layers=LAYERS,
    )  # fmt: skip


def test_layers_leave_the_users_model_alone():
    model = Model(nnx.Rngs(0))
    state = jzero.nnx.TrainState.create(
        model, tx=make_tx(1e-3, eps=EPS), mesh=jzero.data_mesh(), stage=3, layers=Block
    )
    state, _ = state.train_step(loss_fn)(state, make_batches(1)[0])
    assert all(type(b) is Block for b in model.blocks)
    assert all(type(b) is Block for b in state.model().blocks)


@pytest.mark.parametrize(
    "bad", ["Block", jnp.tanh, (Block, 3), int, nnx.Linear(2, 2, rngs=nnx.Rngs(0))]
)
def test_layers_rejects_non_module_classes(bad):
    with pytest.raises(TypeError, match="layers= takes an nnx.Module class"):
        make_state(3, layers=bad)


def test_layers_absent_from_the_model_is_an_error():
    with pytest.raises(ValueError, match="holds no instance of LayerNorm"):
        make_state(3, layers=nnx.LayerNorm)
