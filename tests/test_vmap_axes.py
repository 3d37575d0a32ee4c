"""Losses that bind their own axis with ``jax.vmap(..., axis_name=...)`` and reduce over it
(a Flax BatchNorm under a vmap, Equinox's ``eqx.nn.BatchNorm``). JAX cannot trace such a
collective inside ``jax.shard_map`` with its varying-axes checks; until jzero works around
it, the step names the collective and never advises ``axis_name=`` for the vmap's axis."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

import jzero


class BatchNormed(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        h_BxH = nn.Dense(4)(x_BxD)
        h_BxH = nn.BatchNorm(use_running_average=False, axis_name="batch")(h_BxH)
        return nn.Dense(1)(h_BxH)


def batch() -> dict[str, jax.Array]:
    return {"x": jax.random.normal(jax.random.key(1), (16, 3), jnp.float32) + 1.0}


def flax_vmapped_loss(params, model_state, batch):
    def one(x_D):
        return BatchNormed().apply(
            {"params": params, **model_state}, x_D[None], mutable=["batch_stats"]
        )

    out_Bx1x1, updates = jax.vmap(one, axis_name="batch")(batch["x"])
    return jnp.mean(out_Bx1x1**2), jax.tree.map(lambda a: a[0], updates)


_NAMED = r"jax.lax.psum/pmean \(at .*normalization.py.*binds itself with jax.vmap"


@pytest.mark.parametrize("stage", [0, 3])
def test_a_vmapped_flax_batchnorm_is_named_without_axis_name_advice(stage):
    variables = BatchNormed().init(jax.random.key(0), batch()["x"][:2])
    model_state = {"batch_stats": variables["batch_stats"]}
    jax.jit(flax_vmapped_loss)(variables["params"], model_state, batch())  # plain jit traces
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=stage)
    state = opt.init(variables["params"], model_state=model_state)
    step = opt.train_step(flax_vmapped_loss, with_model_state=True, donate=False)
    with pytest.raises(ValueError, match=_NAMED) as info:
        step(state, batch())
    assert "axis_name='batch'" not in str(info.value)
    assert isinstance(info.value.__cause__, AssertionError)  # JAX's own failure is kept


def test_an_equinox_batchnorm_is_named_without_axis_name_advice():
    model, model_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, model_state, batch):
        bn = eqx.combine(params, static)
        out_BxD, model_state = jax.vmap(
            bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(batch["x"], model_state)
        return jnp.mean(out_BxD**2), model_state

    jax.jit(loss_fn)(params, model_state, batch())  # plain jit traces
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=0)
    step = opt.train_step(loss_fn, with_model_state=True, donate=False)
    with pytest.raises(ValueError, match=r"binds itself with jax.vmap") as info:
        step(opt.init(params, model_state=model_state), batch())
    assert "axis_name='batch'" not in str(info.value)
