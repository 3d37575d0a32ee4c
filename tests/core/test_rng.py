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
from jax.sharding import PartitionSpec as P

import jzero
from jzero.core import rng

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


# ------------------------------------------------- key arrays of any shape, under shard_map
KEY_SHAPES = [(), (3,), (2, 3)]  # one key; one per layer (nnx.split_rngs); a grid of them


def keys_of(shape: tuple[int, ...]) -> jax.Array:
    return jax.random.split(jax.random.key(11), shape) if shape else jax.random.key(11)


def each_key(keys: jax.Array):
    """(index, key) for every element of a key array (one pair for a single key)."""
    return [(idx, keys[idx]) for idx in np.ndindex(keys.shape)]


def on_every_device(body, keys: jax.Array) -> np.ndarray:
    """``body(keys)`` run under ``shard_map`` over 'data' (``keys`` replicated): every
    device's result, stacked, ``uint32[N, *keys.shape, 2]`` (key data)."""
    run = lambda keys: jax.random.key_data(body(keys))[None]
    mesh = jzero.data_mesh()
    return np.asarray(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P("data"))(keys))


def settled(keys: jax.Array, loss) -> jax.Array:
    """Inside the step: what ``settle`` makes of the keys ``loss`` returns for the folded
    ones it is given."""
    seen = rng.for_device({"rng": keys}, "data")
    new = {"rng": loss(seen["rng"])}
    return rng.settle(new, seen=seen, given={"rng": keys}, axes="data")["rng"]


def key_data(key: jax.Array) -> np.ndarray:
    return np.array(jax.random.key_data(key))  # a writable host copy


@pytest.mark.parametrize("shape", KEY_SHAPES)
def test_for_device_folds_every_key_of_a_key_array_with_the_device_index(shape):
    keys = keys_of(shape)
    got = on_every_device(lambda k: rng.for_device({"rng": k}, "data")["rng"], keys)
    assert got.shape == (N, *shape, 2)
    for i in range(N):
        for idx, key in each_key(keys):
            np.testing.assert_array_equal(got[i][idx], key_data(jax.random.fold_in(key, i)))
    folded = {k.tobytes() for k in got.reshape(-1, 2)}
    assert len(folded) == N * keys.size  # per device and per element
    assert not folded & {k.tobytes() for k in key_data(keys).reshape(-1, 2)}


def copy(key: jax.Array) -> jax.Array:
    """A new array holding the same keys (as a key comes back through a remat or a scan)."""
    return jax.random.wrap_key_data(jax.random.key_data(key) + 0)


@pytest.mark.parametrize("loss", [lambda k: k, copy], ids=["same_array", "same_values"])
@pytest.mark.parametrize("shape", KEY_SHAPES)
def test_settle_gives_back_the_unfolded_keys_the_loss_left_as_they_were(shape, loss):
    keys = keys_of(shape)
    got = on_every_device(lambda k: settled(k, loss), keys)
    for i in range(N):
        np.testing.assert_array_equal(got[i], key_data(keys))


def bump(key: jax.Array) -> jax.Array:
    """A key replaced by another (its data plus one): different on every device."""
    return jax.random.wrap_key_data(jax.random.key_data(key) + 1)


@pytest.mark.parametrize("shape", KEY_SHAPES)
def test_settle_makes_replaced_keys_device_zeros_on_every_device(shape):
    keys = keys_of(shape)
    got = on_every_device(lambda k: settled(k, bump), keys)
    want = key_data(keys) * 0
    for idx, key in each_key(keys):
        want[idx] = key_data(jax.random.fold_in(key, 0)) + 1
    for i in range(N):
        np.testing.assert_array_equal(got[i], want)


def test_settle_decides_element_by_element():
    """Of a stacked key, the element the loss replaced is device 0's, the others unfolded."""
    keys = keys_of((3,))
    replace_second = lambda k: jax.random.wrap_key_data(jax.random.key_data(k).at[1].add(1))
    got = on_every_device(lambda k: settled(k, replace_second), keys)
    want = key_data(keys)
    want[1] = key_data(jax.random.fold_in(keys[1], 0)) + 1
    for i in range(N):
        np.testing.assert_array_equal(got[i], want)


def test_settle_agrees_when_only_some_devices_replaced_a_key():
    """Device 0 leaves its keys, the others replace theirs: every device ends with device
    0's (its folded keys), not a mix of unfolded and replaced ones."""
    keys = keys_of((2, 3))

    def some(k):
        data = jax.random.key_data(k)
        return jax.random.wrap_key_data(jnp.where(jax.lax.axis_index("data") == 0, data, data + 1))

    got = on_every_device(lambda k: settled(k, some), keys)
    want = np.stack([key_data(jax.random.fold_in(key, 0)) for _, key in each_key(keys)])
    for i in range(N):
        np.testing.assert_array_equal(got[i], want.reshape(2, 3, 2))


@pytest.mark.parametrize("shape", KEY_SHAPES)
def test_agree_gives_device_zeros_key_array_or_leaves_an_invariant_one(shape):
    keys = keys_of(shape)
    varying = on_every_device(lambda k: rng.agree(bump(rng.for_device(k, "data")), "data"), keys)
    invariant = on_every_device(lambda k: rng.agree(k, "data"), keys)
    want = key_data(keys) * 0
    for idx, key in each_key(keys):
        want[idx] = key_data(jax.random.fold_in(key, 0)) + 1
    for i in range(N):
        np.testing.assert_array_equal(varying[i], want)
        np.testing.assert_array_equal(invariant[i], key_data(keys))
