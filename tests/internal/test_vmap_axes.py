"""Losses that bind their own axis with ``jax.vmap(..., axis_name=...)`` and reduce over it
(Equinox's ``eqx.nn.BatchNorm``, a Flax BatchNorm under a vmap) train as under plain
``jax.jit``, although JAX cannot trace such a collective inside ``jax.shard_map`` with its
varying-axes checks (:mod:`jzero.internal.vmap_axes`).

The oracle is single-device Optax evaluating each batch as 8 slices (device i's rows), each
with its own batch statistics, the loss their mean and the new statistics their mean, as
jzero gives them (``reference(..., groups=8)``). The optimizer is SGD: BatchNorm makes the
true gradient of some biases exactly 0 (a bias that shifts every row alike), and Adam would
turn the rounding noise in it into +-lr updates (docs/design.md, "Traps")."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, reference
from flax import linen as nn

import jzero

DEVICES = 8


class BatchNormed(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        h_BxH = nn.Dense(4)(x_BxD)
        h_BxH = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name="batch")(h_BxH)
        return nn.Dense(1)(nn.tanh(h_BxH))


def batches(steps: int = 2, batch_size: int = 32) -> list[dict[str, jax.Array]]:
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(10 + i))
        x = jax.random.normal(kx, (batch_size, 3), jnp.float32) + 1.0  # O(1) statistics
        out.append({"x": x, "y": jax.random.normal(ky, (batch_size, 1), jnp.float32)})
    return out


def flax_vmapped_loss(params, model_state, batch):
    def one(x_D):
        return BatchNormed().apply(
            {"params": params, **model_state}, x_D[None], mutable=["batch_stats"]
        )

    out_Bx1x1, updates = jax.vmap(one, axis_name="batch")(batch["x"])
    loss = jnp.mean((out_Bx1x1[:, 0] - batch["y"]) ** 2)
    return loss, jax.tree.map(lambda a: a[0], updates)  # the same on every row


class Net(eqx.Module):
    mlp: eqx.nn.MLP
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.mlp = eqx.nn.MLP(3, 4, 8, 2, use_final_bias=False, key=k1)  # BatchNorm's bias instead
        self.bn = eqx.nn.BatchNorm(4, "batch", momentum=0.5, mode="batch")
        self.head = eqx.nn.Linear(4, 1, key=k2)

    def __call__(self, x_D, state):
        h_H, state = self.bn(self.mlp(x_D), state)
        return self.head(jnp.tanh(h_H)), state


def equinox_case():
    net, model_state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    params, static = eqx.partition(net, eqx.is_inexact_array)

    def loss_fn(params, model_state, batch):
        net = eqx.combine(params, static)
        out_Bx1, model_state = jax.vmap(
            net, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(batch["x"], model_state)
        return jnp.mean((out_Bx1 - batch["y"]) ** 2), model_state

    return params, model_state, loss_fn


def flax_case():
    variables = BatchNormed().init(jax.random.key(0), batches(1)[0]["x"][:2])
    return variables["params"], {"batch_stats": variables["batch_stats"]}, flax_vmapped_loss


def check_against_single_device(case, stage: int) -> None:
    params, model_state, loss_fn = case()
    tx, data = optax.sgd(0.1), batches()
    ref = reference(tx, params, loss_fn, data, model_state=model_state, groups=DEVICES)
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage)
    state = opt.init(params, model_state=model_state)
    step = opt.train_step(loss_fn, with_model_state=True)
    for batch, want in zip(data, ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    # The batch statistics are summed over 8 devices here and within one vmap in the
    # reference: fp32 rounding of a 32-term sum of O(1) terms (~32 x 2**-24 = 2e-6) in each
    # step's statistics and gradient, over 2 steps (momentum 0.5, SGD's lr 0.1): within
    # 1e-6 (jax 0.12 measured 1.4e-7 on one running statistic of the equinox model).
    assert_tree_close(state.model_state, ref.model_state, rtol=1e-6, atol=1e-6)
    assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_equinox_batchnorm_and_mlp_train_as_single_device_optax(stage):
    check_against_single_device(equinox_case, stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_vmapped_flax_batchnorm_trains_as_single_device_optax(stage):
    check_against_single_device(flax_case, stage)


def test_an_unknown_axis_beside_a_vmapped_one_is_named_without_the_vmapped_one():
    params = {"w": jnp.ones((3, 4), jnp.float32)}

    def loss_fn(params, batch):
        def one(x_D):
            h_H = x_D @ params["w"]
            return h_H - jax.lax.pmean(h_H, "batch")

        h_BxH = jax.vmap(one, axis_name="batch")(batch["x"])
        return jax.lax.all_gather(h_BxH.sum(), "devices").sum()

    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=0)
    step = opt.train_step(loss_fn, donate=False)
    with pytest.raises(ValueError, match=r"all_gather over axis 'devices'") as info:
        step(opt.init(params), batches(1)[0])
    assert "'batch'" not in str(info.value)


def test_micro_batches_take_their_own_statistics():
    """grad_accum=2: each device's two micro-batches are 16 slices of the batch in all."""
    params, model_state, loss_fn = equinox_case()
    tx, data = optax.sgd(0.1), batches(1)
    ref = reference(tx, params, loss_fn, data, model_state=model_state, groups=2 * DEVICES)
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=3)
    step = opt.train_step(loss_fn, with_model_state=True, grad_accum=2)
    state, metrics = step(opt.init(params, model_state=model_state), data[0])
    np.testing.assert_allclose(float(metrics["loss"]), ref.losses[0], rtol=1e-6)
    # Micro-batch gradients summed in another order: 2.7e-7 at most on a CPU with AVX2, and
    # 1.5e-6 with AVX-512, where XLA:CPU vectorises the sums differently (2 of 64 elements)
    assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=3e-6)


def test_a_custom_vjp_in_such_a_loss_is_refused_naming_its_line_and_the_fix():
    @jax.custom_vjp
    def clipped_grad(x):
        return x

    clipped_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    def loss_fn(params, batch):
        def one(x_D):
            h_H = clipped_grad(x_D @ params["w"])
            return h_H - jax.lax.pmean(h_H, "batch")

        return jnp.mean(jax.vmap(one, axis_name="batch")(batch["x"]) ** 2)

    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=0)
    step = opt.train_step(loss_fn, donate=False)
    with pytest.raises(NotImplementedError, match=r"custom_vjp function \(at .*test_vmap_axes"):
        step(opt.init({"w": jnp.ones((3, 4), jnp.float32)}), batches(1)[0])
