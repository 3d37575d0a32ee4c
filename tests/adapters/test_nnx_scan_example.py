"""Flax's NNX scan-over-layers example, vendored unchanged (``tests/vendor/flax_nnx_scan``),
trains under ``jzero.nnx.TrainState`` at every stage, dropout on and off.

``ScanMLP`` makes its blocks with ``nnx.split_rngs`` + ``nnx.vmap`` and applies them with
``nnx.scan``; each ``Block`` is Linear -> BatchNorm -> Dropout(0.5) -> gelu. Its dropout
stream therefore holds a key *array*, one key per layer (shape ``(LAYERS,)``), which jzero
folds element by element with the device's index (:mod:`jzero.core.rng`).

The oracle is plain Optax on one device. BatchNorm in training mode normalises each
device's rows with their own statistics and jzero averages the new running statistics over
'data', so the oracle evaluates the batch as N slices (device i's rows), averages their
losses and statistics (as ``tests/adapters/test_flax.py`` explains). With dropout on, device i's
streams are folded with i: the oracle folds slice i's keys with i too, and then the two
agree as closely as with dropout off; the RNG state itself (the key as it was, the count
advanced by one draw per layer per step) is compared with an ``nnx.Optimizer`` run of the
whole batch on one device, which is what NNX itself does.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_text import all_gathers
from flax import nnx
from vendor.flax_nnx_scan import EXAMPLE, Block, ScanMLP

import jzero
from jzero.accounting import collectives

N = 8  # devices
DIM, LAYERS = 10, 5  # the example's own model: ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0))
# 16 rows per device (a batch of 128): BatchNorm over 4 rows amplified fp32 rounding so much
# that both sides ended ~1e-4 from an fp64 run (and ~5e-6 from each other); over 16 rows
# they agree to ~1e-7.
ROWS, STEPS = 16, 3  # rows per device, steps trained
UPSTREAM_BLOB = "8015e926ea886a226837af395c1e7993b2b87466"  # SOURCE.md
# fp32 on both sides. SGD, not Adam: the Linear bias before BatchNorm has a true gradient
# of exactly 0, i.e. rounding noise that differs with the order of the device sums, and
# Adam would turn that noise into updates of about lr (docs/design.md, "Traps").
RTOL, ATOL = 1e-6, 1e-6
TX = lambda: optax.sgd(0.1, momentum=0.9)
# Dropout(rate) with 1 - rate rounding to 1.0 in fp32: every mask keeps everything and scales
# by exactly 1, but the stream is drawn from (at rate == 0.0 exactly, nnx.Dropout returns
# its input without drawing).
KEEP_ALL = 1e-9


def example(*, rate: float | None = None, deterministic: bool = False) -> ScanMLP:
    """The example's model; ``deterministic`` switches dropout off, ``rate`` sets its rate."""
    model = ScanMLP(DIM, n_layers=LAYERS, rngs=nnx.Rngs(0))
    if deterministic:
        model.set_attributes(nnx.Dropout, deterministic=True)
    if rate is not None:
        model.set_attributes(nnx.Dropout, rate=rate)
    return model


def loss_fn(model: ScanMLP, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batches(steps: int = STEPS) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(3), steps)
    shape = (N * ROWS, DIM)
    return [
        {
            "x": jax.random.normal(k, shape, jnp.float32),
            "y": jax.random.normal(jax.random.fold_in(k, 1), shape, jnp.float32) * 0.5,
        }
        for k in keys
    ]


def is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def fold_each(keys: jax.Array, i: int) -> jax.Array:
    """``jax.random.fold_in(keys[j], i)`` for each layer's key ``j``."""
    return jax.vmap(lambda key: jax.random.fold_in(key, i))(keys)


def stream(model_state: Any) -> dict[str, jax.Array]:
    """The dropout stream of the example's blocks: ``key`` and ``count``, shape (LAYERS,)."""
    return model_state["layers"]["dropout"]["rngs"]


class Run(NamedTuple):
    """Where a run ends: losses, trained Params and the other state (pure dicts)."""

    losses: list[float]
    params: Any
    rest: Any


def combine(given: jax.Array, *slices: jax.Array) -> jax.Array:
    """One model-state leaf from the N slices' new ones, as jzero makes them agree: floats
    averaged, integers (counts) the max; keys stay as they were (NNX counts its draws)."""
    if is_key(given):
        return given
    stacked = jnp.stack(slices)
    return stacked.mean(0) if jnp.issubdtype(stacked.dtype, jnp.inexact) else stacked.max(0)


def single_device(model: ScanMLP, *, fold_keys: bool) -> Run:
    """Plain Optax on one device, each step's loss the mean over the N slices' losses; with
    ``fold_keys``, slice i runs with every key folded with i (as device i does)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = jax.device_put((params, rest), jax.devices()[0])
    tx = TX()

    def slice_loss(params, rest, batch, i):
        # a fresh copy of the state (NNX refuses Variables made outside this trace)
        fold = lambda x: fold_each(x, i) if fold_keys and is_key(x) else x
        model = nnx.merge(graphdef, params, jax.tree.map(fold, rest))
        return loss_fn(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    def sliced_loss(params, rest, batch):
        rows = lambda i: jax.tree.map(lambda x: x[i * ROWS : (i + 1) * ROWS], batch)
        losses, states = zip(*(slice_loss(params, rest, rows(i), i) for i in range(N)))
        return jnp.mean(jnp.stack(losses)), jax.tree.map(combine, rest, *states)

    @jax.jit
    def step(params, rest, opt_state, batch):
        (loss, rest), grads = jax.value_and_grad(sliced_loss, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in make_batches():
        params, rest, opt_state, loss = step(params, rest, opt_state, batch)
        losses.append(float(loss))
    return Run(losses, nnx.to_pure_dict(params), nnx.to_pure_dict(rest))


@functools.cache
def plain_oracle() -> Run:
    return single_device(example(deterministic=True), fold_keys=False)


@functools.cache
def folded_oracle() -> Run:
    return single_device(example(), fold_keys=True)


@functools.cache
def nnx_optimizer_stream() -> dict[str, np.ndarray]:
    """The example's dropout stream after STEPS steps of plain NNX on one device
    (``nnx.Optimizer``, the whole batch): key data and count."""
    model = example()
    optimizer = nnx.Optimizer(model, TX(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(loss_fn)(model, batch))

    for batch in make_batches():
        step(model, optimizer, batch)
    rngs = stream(nnx.to_pure_dict(nnx.state(model, nnx.RngState)))
    return {"key": np.asarray(jax.random.key_data(rngs["key"])), "count": np.asarray(rngs["count"])}


def train(model: ScanMLP, stage: int, **create: Any) -> tuple[jzero.nnx.TrainState, list[float]]:
    state = jzero.nnx.TrainState.create(
        model, tx=TX(), mesh=jzero.data_mesh(), stage=stage, **create
    )
    step, losses = state.train_step(loss_fn), []
    for batch in make_batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def host(x: jax.Array) -> np.ndarray:
    """A leaf's value on the host; a key as its key data."""
    return np.asarray(jax.random.key_data(x) if is_key(x) else x)


def assert_same_on_every_device(tree: Any) -> None:
    for x in jax.tree.leaves(tree):
        data = jax.random.key_data(x) if is_key(x) else x
        shards = [np.asarray(s.data) for s in data.addressable_shards]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def assert_matches(state: jzero.nnx.TrainState, losses: list[float], want: Run) -> None:
    """Losses, Params, BatchNorm statistics close to ``want``; RNG keys and counts equal."""
    np.testing.assert_allclose(losses, want.losses, rtol=RTOL, atol=ATOL)
    _, params, rest = nnx.split(state.model(), nnx.Param, ...)
    for got, ref in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    for got, ref in zip(jax.tree.leaves(nnx.to_pure_dict(rest)), jax.tree.leaves(want.rest)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        if jnp.issubdtype(got.dtype, jnp.inexact):
            np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
        else:  # keys (as key data) and counts
            np.testing.assert_array_equal(host(got), host(ref))
    assert_same_on_every_device(state.zero.model_state)


def test_the_vendored_example_is_upstreams_file_byte_for_byte():
    data = EXAMPLE.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
    assert blob == UPSTREAM_BLOB


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropout_off_matches_single_device_optax(stage):
    state, losses = train(example(deterministic=True), stage)
    assert_matches(state, losses, plain_oracle())
    assert {int(c) for c in stream(state.zero.model_state)["count"]} == {0}  # nothing drawn


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropout_on_matches_single_device_optax_with_each_slice_on_its_folded_keys(stage):
    state, losses = train(example(), stage)
    assert_matches(state, losses, folded_oracle())
    # The stream is what plain NNX on one device ends with: the key as it was, the count
    # advanced by one draw per layer per step (and the same on every device, above).
    rngs, want = stream(state.zero.model_state), nnx_optimizer_stream()
    np.testing.assert_array_equal(host(rngs["key"]), want["key"])
    np.testing.assert_array_equal(host(rngs["count"]), want["count"])
    np.testing.assert_array_equal(want["count"], np.full(LAYERS, STEPS))


def test_dropout_on_with_layers_option_matches_and_keeps_the_keys_unfolded():
    """``layers=Block`` gathers each block inside a rematerialised call: the stream's key
    array comes back from it as a new array of the same values, recognised as kept."""
    state, losses = train(example(), 3, layers=Block)
    assert_matches(state, losses, folded_oracle())
    key = host(stream(state.zero.model_state)["key"])
    np.testing.assert_array_equal(key, nnx_optimizer_stream()["key"])


@functools.cache
def rate_oracle(rate: float) -> Run:
    return single_device(example(rate=rate), fold_keys=False)


@pytest.mark.parametrize(
    ("stage", "rate"), [*((s, KEEP_ALL) for s in (0, 1, 2, 3)), (0, 0.0), (3, 0.0)]
)
def test_dropout_on_at_rate_zero_matches_single_device_optax(stage, rate):
    """Dropout on (keys folded per device, masks drawn and streams counted at KEEP_ALL),
    masks that keep everything: the same numbers as the model without dropout."""
    state, losses = train(example(rate=rate), stage)
    assert_matches(state, losses, rate_oracle(rate))
    np.testing.assert_allclose(losses, plain_oracle().losses, rtol=RTOL, atol=ATOL)
    draws = 0 if rate == 0.0 else STEPS  # nnx.Dropout skips the draw at rate 0.0 exactly
    np.testing.assert_array_equal(host(stream(state.zero.model_state)["count"]), draws)


def seen_keys_and_outputs(model: ScanMLP, batch: dict[str, jax.Array]):
    """The loss, and as integer aux (summed over devices, so every device's row is there):
    the dropout keys this device's model holds, ``uint32[N, LAYERS, 2]`` (key data), and the
    bits of its output, ``int32[N, ROWS, DIM]``."""
    i = jax.lax.axis_index("data")
    keys_Lx2 = jax.random.key_data(model.layers.dropout.rngs.key[...])
    y_RxD = model(batch["x"])
    bits_RxD = jax.lax.bitcast_convert_type(y_RxD, jnp.int32)
    keys = jnp.zeros((N, *keys_Lx2.shape), keys_Lx2.dtype).at[i].set(keys_Lx2)
    bits = jnp.zeros((N, *bits_RxD.shape), jnp.int32).at[i].set(bits_RxD)
    return jnp.mean((y_RxD - batch["y"]) ** 2), (keys, bits)


@pytest.mark.parametrize("per_device_rng", [True, False])
@pytest.mark.parametrize("stage", [0, 3])
def test_every_device_and_layer_draws_from_its_own_key(stage, per_device_rng):
    """Every device gets the same rows, so devices' outputs differ only by their masks."""
    rows = make_batches(1)[0]["x"][:ROWS]
    batch = {"x": jnp.tile(rows, (N, 1)), "y": jnp.zeros((N * ROWS, DIM))}
    state = jzero.nnx.TrainState.create(example(), tx=TX(), mesh=jzero.data_mesh(), stage=stage)
    keys = stream(state.zero.model_state)["key"]
    want = [fold_each(keys, i) if per_device_rng else keys for i in range(N)]
    want = np.stack([jax.random.key_data(k) for k in want])
    step = state.train_step(seen_keys_and_outputs, has_aux=True, per_device_rng=per_device_rng)
    seen, bits = map(np.asarray, step(state, batch)[1]["aux"])
    np.testing.assert_array_equal(seen, want)
    distinct_outputs = len({b.tobytes() for b in bits})
    if per_device_rng:  # N x LAYERS different keys, N different outputs
        assert len({k.tobytes() for k in seen.reshape(N * LAYERS, -1)}) == N * LAYERS
        assert distinct_outputs == N
    else:  # the control: one key per layer, the same output on every device
        assert len({k.tobytes() for k in seen.reshape(N * LAYERS, -1)}) == LAYERS
        assert distinct_outputs == 1


def test_stage3_gathers_each_layer_inside_the_scan_forward_and_backward():
    """The default stage-3 step over ``nnx.scan``: each block's kernel is all-gathered once
    per layer in forward and again in backward, and no stacked leaf is gathered whole."""
    state = jzero.nnx.TrainState.create(example(), tx=TX(), mesh=jzero.data_mesh(), stage=3)
    compiled = state.train_step(loss_fn).lower(state, make_batches(1)[0]).compile()
    kernel = state.zero.params["layers"]["linear"]["kernel"].shape[1:]  # padded (DIM, 16)
    assert all_gathers(compiled, kernel) == 2 * LAYERS
    gathers = [c for c in collectives(compiled.as_text()) if c.kind == "all-gather"]
    assert gathers and all(c.trip_count == LAYERS for c in gathers), gathers  # in the loops
    stacked = {x.shape for x in jax.tree.leaves(state.zero.params)}
    assert not {c.shape for c in gathers} & stacked
