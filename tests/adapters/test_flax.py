"""Flax Linen and NNX models (scanned and unscanned layers, BatchNorm) under jzero.

The oracle is plain Flax + Optax on one device. BatchNorm in training mode normalises each
device's slice with that slice's statistics, and jzero averages the new running statistics
over 'data'. The reference computes exactly that on one device: it splits the global
batch into as many groups as the data axis has devices, runs the model on each group
(``jax.vmap``), averages the losses (so the gradient is the mean of the groups') and the
new running statistics. For the running *mean* that average is the global-batch mean;
for the running *variance* it is the mean of per-group variances, not the global-batch
variance (checked below), which is what every data-parallel BatchNorm without a
cross-device reduction of its forward statistics gives.
"""

from __future__ import annotations

import functools
import re
import sys

import _models
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_tx, reference
from _paths import EXAMPLES
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jzero

sys.path.insert(0, str(EXAMPLES))
import train_classifier  # noqa: E402

D, LAYERS, CLASSES, BATCH, STEPS = 12, 2, 4, 32, 3
# Small fp32 MLPs with BatchNorm: the sharded step sums per-device gradients in another
# order than the vmapped reference, so results agree to fp32 rounding; 1e-5 leaves room for
# that rounding to grow through BatchNorm's 1/sqrt(var) over 3 Adam steps (eps=1e-6, so
# Adam does not amplify near-zero gradient noise, docs/design.md, "Traps").
RTOL, ATOL = 1e-5, 1e-6


def make_batches(n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [
        {
            "x": jax.random.normal(k, (BATCH, D), jnp.float32),
            "y": jax.random.randint(jax.random.fold_in(k, 1), (BATCH,), 0, CLASSES),
        }
        for k in keys
    ]


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def assert_tree_close(got, want):
    _models.assert_tree_close(got, want, rtol=RTOL, atol=ATOL)


def assert_same_on_every_device(tree):
    for x in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])


# ---------------------------------------------------------------------------- Linen
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(
            nn.BatchNorm(use_running_average=False)(nn.Dense(D, use_bias=False)(x))
        ), None


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(D, use_bias=False)(x)))
        blocks = nn.scan(
            LinenBlock,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(CLASSES)(x)


def linen_loss(params, model_state, batch):
    logits, updates = LinenMLP().apply(
        {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
    )
    return xent(logits, batch["y"]), updates


@functools.cache
def linen_reference():
    variables = LinenMLP().init(jax.random.key(0), jnp.zeros((2, D)))
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    ref = reference(
        make_tx(), params, linen_loss, make_batches(STEPS), model_state=model_state, groups=8
    )
    return variables, (ref.params, ref.model_state, ref.losses)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_matches_single_device(stage):
    variables, (ref_params, ref_ms, ref_losses) = linen_reference()
    state = jzero.linen.TrainState.create(
        apply_fn=LinenMLP().apply, variables=variables, tx=make_tx(), mesh=jzero.data_mesh(),
        stage=stage,
    )  # fmt: skip
    step = state.train_step(linen_loss)
    losses = []
    for batch in make_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(state.params, ref_params)
    assert_tree_close(state.model_state, ref_ms)
    assert_same_on_every_device(state.model_state)
    assert set(state.variables) == {"params", "batch_stats"}


def test_linen_running_mean_is_global_batch_mean_but_variance_is_not():
    variables, _ = linen_reference()
    state = jzero.linen.TrainState.create(
        apply_fn=LinenMLP().apply, variables=variables, tx=make_tx(), mesh=jzero.data_mesh(),
        stage=1,
    )  # fmt: skip
    batch = make_batches(1)[0]
    state, _ = state.train_step(linen_loss)(state, batch)
    # One plain full-batch forward from the same initial variables.
    _, full = LinenMLP().apply(variables, batch["x"], mutable=["batch_stats"])
    got, want = state.model_state["batch_stats"]["BatchNorm_0"], full["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["var"], want["var"], rtol=1e-3)  # mean of per-device variances


def test_linen_init_fn_and_no_params_error():
    model = LinenMLP()
    init_fn = functools.partial(model.init, jax.random.key(0), jnp.zeros((2, D)))
    state = jzero.linen.TrainState.create(
        apply_fn=model.apply, init_fn=init_fn, tx=make_tx(), mesh=jzero.data_mesh(), stage=3
    )
    kernel = state.zero.params["blocks"]["Dense_0"]["kernel"]  # [LAYERS, D, D], D over 8
    assert kernel.sharding.spec == P(None, None, "data")
    assert kernel.addressable_shards[0].data.shape == (LAYERS, D, 2)  # 12 padded to 16
    assert_tree_close(state.params, init_fn()["params"])
    with pytest.raises(
        ValueError, match=r"can't find the model's params.*\['BatchNorm_0', 'Dense_0'"
    ):
        jzero.linen.TrainState.create(
            apply_fn=model.apply, variables=init_fn()["params"], tx=make_tx(),
            mesh=jzero.data_mesh(), stage=1,
        )  # fmt: skip


# ---------------------------------------------------------------------------- NNX
class NNXBlock(nnx.Module):
    def __init__(self, rngs, model_axis):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, model_axis))
        self.linear = nnx.Linear(D, D, use_bias=False, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.linear(x)))


class NNXMLP(nnx.Module):
    def __init__(self, rngs, model_axis=None):
        self.inp = NNXBlock(rngs, model_axis)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def make_blocks(rngs):
            return NNXBlock(rngs, model_axis)

        self.blocks = make_blocks(rngs)
        self.out = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return self.out(body(self.blocks, self.inp(x)))


def nnx_loss(model, batch):
    return xent(model(batch["x"]), batch["y"])


def make_nnx(model_axis=None):
    with nnx.use_eager_sharding(False):
        return NNXMLP(nnx.Rngs(0), model_axis)


@functools.cache
def nnx_reference(groups):
    graphdef, params, rest = nnx.split(make_nnx(), nnx.Param, ...)

    def loss(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return nnx_loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    ref = reference(make_tx(), params, loss, make_batches(STEPS), model_state=rest, groups=groups)
    return ref.params, ref.model_state, ref.losses


def train_nnx(state):
    step, losses = state.train_step(nnx_loss), []
    for batch in make_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("stage", [0, 1, 2, pytest.param(3, marks=pytest.mark.smoke)])
def test_nnx_matches_single_device(stage):
    ref_params, ref_rest, ref_losses = nnx_reference(8)
    state = jzero.nnx.TrainState.create(
        make_nnx(), tx=make_tx(), mesh=jzero.data_mesh(), stage=stage
    )
    state, losses = train_nnx(state)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert_same_on_every_device(state.zero.model_state)
    _, params, rest = nnx.split(state.model(), nnx.Param, ...)
    assert_tree_close(params, ref_params)
    assert_tree_close(rest, ref_rest)


def test_nnx_model_axis_shardings():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = jzero.nnx.TrainState.create(make_nnx("model"), tx=make_tx(), mesh=mesh, stage=3)
    kernel = state.zero.params["blocks"]["linear"]["kernel"]  # [LAYERS, D, D]
    assert kernel.sharding.spec == P(None, "data", "model")
    assert kernel.addressable_shards[0].data.shape == (LAYERS, D // 4, D // 2)
    mu = state.zero.opt_state[0].mu["blocks"]["linear"]["kernel"]
    assert mu.sharding.spec == P(None, "data", "model")
    assert state.zero.params["inp"]["linear"]["kernel"].sharding.spec == P("data", "model")
    assert state.zero.params["out"]["kernel"].sharding.spec == P(None, "data")
    ref_params, _, ref_losses = nnx_reference(4)
    state, losses = train_nnx(state)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert_tree_close(nnx.split(state.model(), nnx.Param, ...)[1], ref_params)
    assert state.zero.params["blocks"]["linear"]["kernel"].sharding.spec == P(None, "data", "model")


def test_nnx_mesh_errors():
    with pytest.raises(ValueError, match=r"\['blocks'\]\['linear'\]\['kernel'\].*'model'.*mesh"):
        jzero.nnx.TrainState.create(
            make_nnx("model"), tx=make_tx(), mesh=jzero.data_mesh(), stage=2
        )
    mesh = jax.make_mesh((1, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(
        ValueError,
        match=r"\['kernel'\] has shape \(2, 12, 12\); dim 2 \(12\).*'model',\) of size 8",
    ):
        jzero.nnx.TrainState.create(make_nnx("model"), tx=make_tx(), mesh=mesh, stage=2)


def test_train_classifier_script(capsys):
    argv = ["--steps", "40", "--stage", "3", "--batch-size", "64"]
    assert train_classifier.main(argv) == 0
    out = capsys.readouterr().out
    found = re.search(r"loss fell from (\S+) to (\S+), test accuracy (\S+)", out)
    first, last, acc = map(float, found.groups())
    assert last < first and 0 <= acc <= 1
