"""Stage 3's default step gathers each layer where it is used, with no ``manual_gather``.

The loss functions here are written as for one device: no ``jzero.gather``, no
``remat_layer``, no wrapper. Layers run in a ``lax.scan`` / ``nn.scan`` / ``nnx.scan``
over stacked parameters, or unrolled (each layer in ``jax.checkpoint``, or not). jzero
gathers each layer's slice inside the loop body, or each weight at its use (and again in
backward), so stage 3 holds about one layer's gathered parameters: 2 x layers all-gathers
per weight, peak within model states / N + 3 layers + activations, numerics equal to
single-device Optax.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_text import all_gathers
from _models import assert_trains_as, reference, regression_batches
from _residual_block import D, H, NNXBlock
from flax import nnx

import jzero
from jzero.accounting import collectives

N, L, B, STEPS = 8, 8, 64, 3  # the 8 x (256x1024, 1024x256) model
LAYER = 2 * D * H  # parameters per layer
PSI = L * LAYER
# Adam's eps above the gradients' fp32 rounding noise (device sums in another order).
TX = lambda: optax.adam(1e-3, eps=1e-4)


def mlp(p, x_BxD):
    return x_BxD + jnp.tanh(x_BxD @ p["w1"]) @ p["w2"]


def stacked_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = jax.random.normal(k1, (L, D, H), jnp.float32) / 16
    w2 = jax.random.normal(k2, (L, H, D), jnp.float32) / 32
    return {"layers": {"w1": w1, "w2": w2}}


def unrolled_params():
    p = stacked_params()["layers"]
    return {"layers": [{"w1": p["w1"][i], "w2": p["w2"][i]} for i in range(L)]}


def mse(x_BxD, batch):
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def scan_loss(params, batch):
    x_BxD, _ = jax.lax.scan(lambda x, p: (mlp(p, x), None), batch["x"], params["layers"])
    return mse(x_BxD, batch)


def checkpointed_loss(params, batch):  # unrolled, each layer rematerialised by the user
    x_BxD = batch["x"]
    for p in params["layers"]:
        x_BxD = jax.checkpoint(mlp)(p, x_BxD)
    return mse(x_BxD, batch)


def unrolled_loss(params, batch):  # unrolled, no checkpoint: gathered at each use
    x_BxD = batch["x"]
    for p in params["layers"]:
        x_BxD = mlp(p, x_BxD)
    return mse(x_BxD, batch)


PLAIN = {
    "scan": (stacked_params, scan_loss),
    "checkpointed": (unrolled_params, checkpointed_loss),
    "unrolled": (unrolled_params, unrolled_loss),
}


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x_BxD, _):
        h_BxH = jnp.tanh(nn.Dense(H, use_bias=False)(x_BxD))
        return x_BxD + nn.Dense(D, use_bias=False)(h_BxH), None


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        blocks = nn.scan(
            LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
        )
        x_BxD, _ = blocks()(x_BxD, None)
        return x_BxD


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap
        def make_blocks(rngs):
            return NNXBlock(rngs)

        self.blocks = make_blocks(rngs)

    def __call__(self, x_BxD):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def layers(block, x_BxD):
            return block(x_BxD)

        return layers(self.blocks, x_BxD)


def batches(steps=STEPS):
    return regression_batches(steps, B, D)


def linen_loss(params, batch):
    return mse(LinenModel().apply({"params": params}, batch["x"]), batch)


def nnx_loss(model, batch):
    return mse(model(batch["x"]), batch)


def _setup(model: str, stage: int):
    """(state, step, full params of a state, single-device params and loss) of a model."""
    if model == "linen":
        variables = LinenModel().init(jax.random.key(0), batches(1)[0]["x"])
        state = jzero.linen.TrainState.create(
            apply_fn=LinenModel().apply, variables=variables, tx=TX(),
            mesh=jzero.data_mesh(), stage=stage,
        )  # fmt: skip
        full = lambda state: state.params
        return state, state.train_step(linen_loss), full, variables["params"], linen_loss
    if model == "nnx":
        state = jzero.nnx.TrainState.create(
            NNXModel(nnx.Rngs(0)), tx=TX(), mesh=jzero.data_mesh(), stage=stage
        )
        graphdef, params = nnx.split(NNXModel(nnx.Rngs(0)))
        loss = lambda params, batch: nnx_loss(nnx.merge(graphdef, params), batch)
        full = lambda state: nnx.state(state.model(), nnx.Param)
        return state, state.train_step(nnx_loss), full, params, loss
    make_params, loss = PLAIN[model]
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=stage)
    state = opt.init(make_params())
    return state, opt.train_step(loss), opt.full_params, make_params(), loss


@functools.cache
def compiled(model: str, stage: int = 3):
    state, step, *_ = _setup(model, stage)
    return step.lower(state, batches(1)[0]).compile()


LAYERED = ["scan", "checkpointed", "linen", "nnx"]


@pytest.mark.parametrize("model", LAYERED)
def test_every_weight_is_gathered_once_per_layer_in_forward_and_in_backward(model):
    for shape in [(D, H), (H, D)]:
        assert all_gathers(compiled(model), shape) == 2 * L, shape


@pytest.mark.parametrize("model", [*LAYERED, "unrolled"])
def test_stage3_peak_holds_model_states_over_n_plus_three_layers(model):
    mem = compiled(model).memory_analysis()
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    model_states = 16 * PSI  # fp32 params, grads and Adam's two moments
    # Per device: each layer's saved input and tanh (activations kept, FSDP's trade),
    # plus one layer's working set (input, hidden, output and their cotangents).
    activations = 4 * (B // N) * (L * (D + H) + 2 * (2 * D + H))
    bound = model_states / N + 3 * 4 * LAYER + activations
    print(f"{model}: stage-3 peak {peak:,} B, bound {bound:,} B")
    assert peak <= bound, (peak, bound)


@pytest.mark.parametrize("model", ["scan", "linen", "nnx"])
def test_a_scan_runs_as_two_loops_saving_each_layers_input_once(model):
    # Forward and backward. Under the step's outer checkpoint JAX would save each step's
    # output carry and stage a third loop into backward, shifting that stack by one step
    # to rebuild the inputs: two stacks of every layer's activation alive at once.
    assert compiled(model).as_text().count(" while(") == 2


def test_unrolled_layers_without_checkpoint_are_gathered_at_each_use():
    # No loop and no rematerialised region: each weight is gathered at its use and again
    # in backward (jzero.core.gather.deferred; more in test_unrolled_stage3.py), except the
    # first layer's w1, which backward has no use for (no cotangent of the batch).
    assert all_gathers(compiled("unrolled"), (D, H)) == 2 * L - 1
    assert all_gathers(compiled("unrolled"), (H, D)) == 2 * L
    unrolled = compiled("unrolled").memory_analysis().temp_size_in_bytes
    assert unrolled < compiled("checkpointed").memory_analysis().temp_size_in_bytes + 4 * LAYER


@pytest.mark.parametrize("model", [*LAYERED, pytest.param("unrolled", marks=pytest.mark.smoke)])
def test_stage3_default_step_matches_single_device_optax(model):
    state, step, full, params, loss = _setup(model, 3)
    assert_trains_as(reference(TX(), params, loss, batches()), step, state, full, batches())


def test_a_stack_sharded_along_its_layers_axis_is_gathered_whole_and_exact():
    # A stack of L scalars per layer (shape [L]) can only be sharded along the layers
    # axis, which a scan step cannot slice: it is gathered whole, before the loop.
    def loss(params, batch):
        def layer(x_BxD, p):
            return mlp(p, x_BxD) * p["gain"], None

        x_BxD, _ = jax.lax.scan(layer, batch["x"], params["layers"])
        return mse(x_BxD, batch)

    params = stacked_params()
    params["layers"]["gain"] = jnp.linspace(0.9, 1.1, L)
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=3)
    state = opt.init(params)
    assert state.params["layers"]["gain"].sharding.spec == jax.sharding.PartitionSpec("data")
    step = opt.train_step(loss)
    assert all_gathers(step.lower(state, batches(1)[0]).compile(), (L,)) >= 1
    ref = reference(TX(), params, loss, batches(2))
    for batch, want in zip(batches(2), ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_parameter_used_inside_and_outside_a_jit_is_gathered_and_reduced_once():
    # A tied embedding: looked up inside a jitted function, used again as the output
    # head outside it. One gather (and one reduce-scatter) of it per pass, not one per use.
    V = 64

    @jax.jit
    def embed(table_VxD, tokens_B):
        return table_VxD[tokens_B]

    def loss(params, batch):
        x_BxD, _ = jax.lax.scan(
            lambda x, p: (mlp(p, x), None), embed(params["table"], batch["tokens"]),
            params["layers"],
        )  # fmt: skip
        logits_BxV = x_BxD @ params["table"].T
        logp_BxV = jax.nn.log_softmax(logits_BxV)
        return -jnp.mean(jnp.take_along_axis(logp_BxV, batch["tokens"][:, None], axis=1))

    params = stacked_params() | {"table": jax.random.normal(jax.random.key(5), (V, D)) / 16}
    batch = {"tokens": jax.random.randint(jax.random.key(6), (B,), 0, V)}
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=3)
    state = opt.init(params)
    step = opt.train_step(loss)
    hlo = step.lower(state, batch).compile().as_text()
    scatters = [c for c in collectives(hlo) if c.kind == "reduce-scatter" and V in c.shape]
    assert sum(c.trip_count for c in scatters) == 1
    ref = reference(TX(), params, loss, [batch] * 2)
    for want in ref.losses:
        state, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
