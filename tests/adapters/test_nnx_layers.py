"""Per-layer gathering for Flax NNX: layers stacked with ``nnx.vmap``, run with ``nnx.scan``.

``jzero.nnx.remat_module`` gathers one layer's Params inside a rematerialised region and
``jzero.nnx.gathered`` gathers the other submodules; under
``TrainState.train_step(loss_fn, manual_gather=True)`` stage 3 then holds about one layer's
gathered parameters at a time in forward and in backward. The oracle is plain NNX + Optax
on one device running the same model code (gathering is the identity on plain arrays).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import make_tx, random_pairs, reference
from flax import nnx

import jzero
from jzero.accounting import collectives

N, L, D_IN, D, H, D_OUT, B, STEPS = 8, 8, 16, 128, 256, 8, 64, 3
# fp32 sums over devices in another order than the one-device reference: fp32 rounding.
# Adam's eps=1e-4 sits above the gradients' rounding noise, which Adam would otherwise
# amplify to ~1e-5 for near-zero gradients (eps=1e-6 gives that on 7 of 262k elements).
RTOL, ATOL = 1e-6, 1e-6


class Block(nnx.Module):
    """Pre-norm residual MLP block: x + down(tanh(up(norm(x))))."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x_BxD):
        return x_BxD + self.down(jnp.tanh(self.up(self.norm(x_BxD))))


block = jzero.nnx.remat_module(lambda layer, x_BxD: layer(x_BxD))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(D_IN, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap
        def make_blocks(rngs):
            return Block(rngs)

        self.blocks = make_blocks(rngs)  # Params with a leading [L] axis
        self.head = nnx.Linear(D, D_OUT, rngs=rngs)

    def __call__(self, x_BxI):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def layers(layer, x_BxD):
            return block(layer, x_BxD)

        x_BxD = layers(self.blocks, jzero.nnx.gathered(self.embed)(x_BxI))
        return jzero.nnx.gathered(self.head)(x_BxD)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batches(steps):
    return random_pairs(steps, B, D_IN, D_OUT, seed=1)


def create(stage):
    model = Model(nnx.Rngs(0))
    return jzero.nnx.TrainState.create(
        model, tx=make_tx(1e-3, eps=1e-4), mesh=jzero.data_mesh(), stage=stage
    )


@functools.cache
def plain_reference():
    graphdef, params = nnx.split(Model(nnx.Rngs(0)))
    loss = lambda params, batch: loss_fn(nnx.merge(graphdef, params), batch)
    params, _, losses, _ = reference(make_tx(1e-3, eps=1e-4), params, loss, make_batches(STEPS))
    return params, losses


@functools.cache
def compiled(stage):
    state = create(stage)
    return state.train_step(loss_fn, manual_gather=True).lower(state, make_batches(1)[0]).compile()


def peak_bytes(compiled) -> int:
    mem = compiled.memory_analysis()
    return mem.argument_size_in_bytes + mem.temp_size_in_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_scanned_layers_match_single_device(stage):
    ref_params, ref_losses = plain_reference()
    state = create(stage)
    step, losses = state.train_step(loss_fn, manual_gather=True), []
    for batch in make_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    params = nnx.state(state.model(), nnx.Param)
    for (path, want), got in zip(
        jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(params)
    ):
        assert got.shape == want.shape, path
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(path))
    if stage == 3:
        up = state.zero.params["blocks"]["up"]["kernel"]  # [L, D, H]: D split over 'data'
        assert up.sharding.spec == jax.sharding.PartitionSpec(None, "data")
        assert up.addressable_shards[0].data.shape == (L, D // N, H)


def test_stage3_gathers_each_layer_in_scanned_forward_and_backward():
    gathers = [c for c in collectives(compiled(3).as_text()) if c.kind == "all-gather"]
    for shape in [(D, H), (H, D)]:  # one layer's up and down kernels
        found = [c for c in gathers if c.shape == shape]
        assert [c.trip_count for c in found] == [L, L], found  # inside two L-step loops
        assert len({c.computation for c in found}) == 2  # forward's body and backward's


def test_stage3_holds_about_one_layer_at_a_time():
    layer = 2 * D + (D * H + H) + (H * D + D)  # LayerNorm, up, down
    psi = (D_IN * D + D) + L * layer + (D * D_OUT + D_OUT)
    model_states = 16 * psi  # fp32 params + fp32 grads + Adam's two fp32 moments
    # Activations per device: each layer's input kept for backward, plus one layer's
    # working set (input, norm, up, tanh, output and their cotangents).
    activations = 4 * (B // N) * (L * D + 2 * (3 * D + 2 * H))
    bound = model_states / N + 3 * 4 * layer + activations
    peak = peak_bytes(compiled(3))
    assert peak < bound, (peak, bound)
    assert peak < peak_bytes(compiled(0)) / 4, (peak, peak_bytes(compiled(0)))


class BNBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(D_IN, D_IN, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(D_IN, rngs=rngs)

    def __call__(self, x_BxI):
        return jax.nn.relu(self.bn(self.linear(x_BxI)))


bn_block = jzero.nnx.remat_module(lambda layer, x_BxI: layer(x_BxI))


class BNModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap
        def make_blocks(rngs):
            return BNBlock(rngs)

        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(D_IN, D_OUT, rngs=rngs)

    def __call__(self, x_BxI, *, manual: bool):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def layers(layer, x_BxI):
            return bn_block(layer, x_BxI) if manual else layer(x_BxI)

        head = jzero.nnx.gathered(self.head) if manual else self.head
        return head(layers(self.blocks, x_BxI))


def test_remat_layer_keeps_batch_stats_updates():
    # Stage 3 with per-layer gathering against the default (everything gathered up front),
    # itself checked against the one-device oracle in test_flax.py.
    def run(manual):
        model = BNModel(nnx.Rngs(0))
        state = jzero.nnx.TrainState.create(
            model, tx=make_tx(1e-3, eps=1e-4), mesh=jzero.data_mesh(), stage=3
        )
        loss = lambda model, batch: jnp.mean((model(batch["x"], manual=manual) - batch["y"]) ** 2)
        step, losses = state.train_step(loss, manual_gather=manual), []
        for batch in make_batches(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, nnx.state(state.model())

    losses, variables = run(True)
    want_losses, want_variables = run(False)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    mean = variables["blocks"]["bn"]["mean"]
    assert mean.shape == (L, D_IN) and np.abs(mean).min() > 0  # every layer's stats moved
    for got, want in zip(jax.tree.leaves(variables), jax.tree.leaves(want_variables)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_the_old_name_of_remat_module_warns_and_forwards():
    with pytest.warns(DeprecationWarning, match="renamed jzero.nnx.remat_module"):
        old = jzero.nnx.remat_layer(lambda layer, x: layer(x))
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(
        old(model, x), jzero.nnx.remat_module(lambda m, x: m(x))(model, x)
    )
