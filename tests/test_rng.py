"""Per-device randomness: PRNG keys in the model state are folded with the device's index
inside the step (different dropout masks per device), and come back the same everywhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, reference
from flax import linen as nn
from flax import nnx

import jzero

N, D = 8, 6  # devices, width
ROWS = 2  # rows per device: a batch of 16


class DropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def masks_loss(model, batch):
    """The loss, and this device's dropout mask in its own row of an integer aux (integers
    are summed over devices, so aux holds every device's mask)."""
    h_BxD = model.drop(jnp.ones_like(batch["x"]), deterministic=False)
    loss = jnp.mean((model.linear(batch["x"] * h_BxD) - batch["y"]) ** 2)
    mask_BxD = (h_BxD != 0).astype(jnp.int32)
    rows_NxBxD = jnp.zeros((N, *mask_BxD.shape), jnp.int32)
    return loss, rows_NxBxD.at[jax.lax.axis_index("data")].set(mask_BxD)


def a_batch(seed: int = 0) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (N * ROWS, D), jnp.float32),
        "y": jax.random.normal(ky, (N * ROWS, D), jnp.float32),
    }


def nnx_state() -> jzero.nnx.TrainState:
    return jzero.nnx.TrainState.create(
        DropNet(nnx.Rngs(0)), tx=optax.sgd(0.1), mesh=jzero.data_mesh(), stage=3
    )


@functools.cache
def nnx_step(per_device_rng: bool, grad_accum: int):
    """The step, compiled once per option (each test makes a fresh state: steps donate it)."""
    return nnx_state().train_step(
        masks_loss, has_aux=True, per_device_rng=per_device_rng, grad_accum=grad_accum
    )


def stream(state) -> dict[str, jax.Array]:
    return state.zero.model_state["drop"]["rngs"]


def key_copy(key: jax.Array) -> jax.Array:
    """A key that outlives the state it came from (a step donates the state's buffers)."""
    data = np.asarray(jax.random.key_data(key))  # a host copy: key_data shares the buffer
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def test_nnx_dropout_masks_differ_across_devices_and_are_the_folded_keys_draws():
    state, step = nnx_state(), nnx_step(True, 1)
    key = key_copy(stream(state)["key"])
    key_data = np.asarray(jax.random.key_data(key))
    for count in range(2):
        state, metrics = step(state, a_batch(count))
        masks_NxBxD = np.asarray(metrics["aux"])
        assert len({m.tobytes() for m in masks_NxBxD}) == N  # every device its own mask
        for i in range(N):  # device i draws from fold_in(key, i), then NNX folds the count
            draw = jax.random.fold_in(jax.random.fold_in(key, i), count)
            want = jax.random.bernoulli(draw, 0.5, (ROWS, D))
            np.testing.assert_array_equal(masks_NxBxD[i], want)
    # the state's stream: its key unfolded and unchanged, its count advanced by the draws,
    # the same on every device
    rngs = stream(state)
    for shard in jax.random.key_data(rngs["key"]).addressable_shards:
        np.testing.assert_array_equal(shard.data, key_data)
    assert {int(s.data) for s in rngs["count"].addressable_shards} == {2}


def test_nnx_stream_state_with_grad_accum_advances_once_per_micro_batch():
    state, step = nnx_state(), nnx_step(True, 2)
    for count in range(2):
        state, metrics = step(state, a_batch(count))
        masks = np.asarray(metrics["aux"])  # summed over the 2 micro-batches: 0, 1 or 2
        assert len({m.tobytes() for m in masks}) == N
    assert {int(s.data) for s in stream(state)["count"].addressable_shards} == {4}


def test_per_device_rng_false_gives_every_device_the_same_mask():
    state, step = nnx_state(), nnx_step(False, 1)
    key = key_copy(stream(state)["key"])
    _, metrics = step(state, a_batch())
    masks_NxBxD = np.asarray(metrics["aux"])
    want = jax.random.bernoulli(jax.random.fold_in(key, 0), 0.5, (ROWS, D))
    for i in range(N):
        np.testing.assert_array_equal(masks_NxBxD[i], want)


def dropout_loss(params, model_state, batch):
    """A key kept in the model state and left as it is (per-step keys would fold a counter)."""
    params = jzero.gather(params)
    mask_BxD = jax.random.bernoulli(model_state["rng"], 0.5, batch["x"].shape)
    h_BxD = jnp.tanh(batch["x"] @ params["w"]) * mask_BxD * 2.0
    return jnp.mean((h_BxD - batch["y"]) ** 2), model_state


@pytest.mark.parametrize("stage", [0, 3])
def test_training_equals_a_single_device_run_with_each_slice_on_its_folded_key(stage):
    """What this compares: jzero with per-device keys against plain single-device Optax on a
    loss that averages, over i, the loss of device i's rows under fold_in(key, i)."""
    key = jax.random.key(42)
    params = {"w": jax.random.normal(jax.random.key(1), (D, D), jnp.float32) * 0.5}
    batches = [a_batch(s) for s in range(2)]

    def per_device_reference(params, batch):
        losses = [
            dropout_loss(
                params,
                {"rng": jax.random.fold_in(key, i)},
                {k: v[i * ROWS : (i + 1) * ROWS] for k, v in batch.items()},
            )[0]
            for i in range(N)
        ]
        return jnp.mean(jnp.stack(losses))

    tx = optax.sgd(0.1)
    ref = reference(tx, params, per_device_reference, batches)
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage)
    state = opt.init(params, model_state={"rng": key})
    step = opt.train_step(dropout_loss, with_model_state=True)
    for batch, want in zip(batches, ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=1e-7)
    assert jax.random.key_impl(state.model_state["rng"]) == jax.random.key_impl(key)
    np.testing.assert_array_equal(
        jax.random.key_data(state.model_state["rng"]), jax.random.key_data(key)
    )


def test_a_key_the_loss_replaces_is_device_zeros_on_every_device():
    key = jax.random.key(7)

    def split_loss(params, model_state, batch):
        loss, _ = dropout_loss(params, model_state, batch)
        return loss, {"rng": jax.random.split(model_state["rng"])[0]}

    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=1)
    params = {"w": jnp.ones((D, D), jnp.float32)}
    state = opt.init(params, model_state={"rng": key})
    state, _ = opt.train_step(split_loss, with_model_state=True)(state, a_batch())
    want = jax.random.key_data(jax.random.split(jax.random.fold_in(key, 0))[0])
    for shard in jax.random.key_data(state.model_state["rng"]).addressable_shards:
        np.testing.assert_array_equal(shard.data, want)


class LinenDrop(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(D)(x_BxD))


def test_linen_dropout_with_a_key_and_counter_in_the_model_state():
    """The README's Linen recipe: the key left as it is, a counter folded in per step."""
    key = jax.random.key(3)
    variables = LinenDrop().init(jax.random.key(0), jnp.ones((2, D)))
    variables = {**variables, "rngs": {"key": key, "count": jnp.zeros((), jnp.uint32)}}

    def loss_fn(params, model_state, batch):
        r = model_state["rngs"]
        y_BxD = LinenDrop().apply(
            {"params": params},
            batch["x"],
            rngs={"dropout": jax.random.fold_in(r["key"], r["count"])},
        )
        mask_BxD = (y_BxD != 0).astype(jnp.int32)
        rows_NxBxD = jnp.zeros((N, *mask_BxD.shape), jnp.int32)
        rows_NxBxD = rows_NxBxD.at[jax.lax.axis_index("data")].set(mask_BxD)
        loss = jnp.mean((y_BxD - batch["y"]) ** 2)
        return (loss, rows_NxBxD), {"rngs": {**r, "count": r["count"] + 1}}

    state = jzero.linen.TrainState.create(
        apply_fn=LinenDrop().apply,
        variables=variables,
        tx=optax.sgd(0.1),
        mesh=jzero.data_mesh(),
        stage=2,
    )
    state, metrics = state.train_step(loss_fn, has_aux=True)(state, a_batch())
    assert len({m.tobytes() for m in np.asarray(metrics["aux"])}) == N
    rngs = state.model_state["rngs"]
    np.testing.assert_array_equal(jax.random.key_data(rngs["key"]), jax.random.key_data(key))
    assert {int(s.data) for s in rngs["count"].addressable_shards} == {1}


def test_nnx_state_with_rng_keys_checkpoints_and_restores_typed(tmp_path):
    state, step = nnx_state(), nnx_step(True, 1)
    state, _ = step(state, a_batch())
    with jzero.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state.zero)
        ckpt.wait()
        like = jax.eval_shape(lambda: state.opt.full_params(state.zero))
        restored = ckpt.restore(state.opt, like, model_state=state.zero.model_state).state
    got, want = stream(state.replace(zero=restored)), stream(state)
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(want["key"]))
    assert int(got["count"]) == int(want["count"])
