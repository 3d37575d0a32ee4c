"""Models that name their own batch axis (``nn.BatchNorm(axis_name='batch')``) train unchanged
with ``train_step(..., axis_name='batch')``: synced statistics are the global batch's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, make_tx, reference
from flax import linen as nn
from flax import nnx

import jzero


class ConvNet(nn.Module):
    """Conv -> BatchNorm synced over ``axis_name`` -> relu -> Dense, as ImageNet models are.

    The convolution has no bias: BatchNorm removes it, so its true gradient is exactly 0 and
    Adam would turn rounding noise in it into +-lr updates (docs/design.md, "Traps")."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x_BxHxWxC):
        h = nn.Conv(4, (3, 3), use_bias=False)(x_BxHxWxC)  # BatchNorm's bias takes its place
        h = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name=self.axis_name)(h)
        return nn.Dense(3)(nn.relu(h).mean((1, 2)))


def image_batches(steps: int, batch_size: int = 16) -> list[dict[str, jax.Array]]:
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(10 + i))
        out.append(
            {  # offset, so the statistics are O(1) and a relative tolerance means something
                "x": jax.random.normal(kx, (batch_size, 6, 6, 2), jnp.float32) + 1.0,
                "y": jax.random.normal(ky, (batch_size, 3), jnp.float32),
            }
        )
    return out


def linen_loss(model: nn.Module):
    def loss_fn(params, model_state, batch):
        out_Bx3, updates = model.apply(
            {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((out_Bx3 - batch["y"]) ** 2), updates

    return loss_fn


def linen_case(mesh, stage: int, steps: int):
    """(train state, batches, single-device reference) for the Linen ConvNet. The oracle:
    one device, the whole batch, no axis name: full-batch statistics."""
    variables = ConvNet().init(jax.random.key(0), image_batches(1)[0]["x"][:2])
    tx, batches = make_tx(1e-2), image_batches(steps)
    ref = reference(
        tx,
        variables["params"],
        linen_loss(ConvNet(axis_name=None)),
        batches,
        model_state={"batch_stats": variables["batch_stats"]},
    )
    state = jzero.linen.TrainState.create(
        apply_fn=ConvNet().apply, variables=variables, tx=tx, mesh=mesh, stage=stage
    )
    return state, batches, ref


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_batchnorm_named_batch_matches_single_device_full_batch(stage):
    state, batches, ref = linen_case(jzero.data_mesh(), stage, steps=2)
    step = state.train_step(linen_loss(ConvNet()), axis_name="batch")
    for batch, want in zip(batches, ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    assert_tree_close(state.model_state, ref.model_state, rtol=1e-6, atol=1e-7)
    assert_tree_close(state.params, ref.params, rtol=1e-5, atol=1e-6)
    mean = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert mean.sharding.mesh == state.zero.plan.mesh  # back on the state's own mesh


def test_hybrid_mesh_maps_the_name_onto_replica_and_data():
    state, batches, ref = linen_case(jzero.hybrid_mesh(2), 3, steps=1)
    state, _ = state.train_step(linen_loss(ConvNet()), axis_name="batch")(state, batches[0])
    assert_tree_close(state.model_state, ref.model_state, rtol=1e-6, atol=1e-7)
    assert_tree_close(state.params, ref.params, rtol=1e-5, atol=1e-6)


class NNXConvNet(nnx.Module):
    def __init__(self, axis_name: str | None, rngs: nnx.Rngs):
        self.conv = nnx.Conv(2, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.5, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x_BxHxWxC):
        return self.out(nnx.relu(self.bn(self.conv(x_BxHxWxC))).mean((1, 2)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_nnx_batchnorm_named_batch_matches_single_device_full_batch():
    tx, batches = make_tx(1e-2), image_batches(1)
    graphdef, params, rest = nnx.split(NNXConvNet(None, nnx.Rngs(0)), nnx.Param, ...)

    def ref_loss(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        loss = nnx_loss(model, batch)
        return loss, nnx.split(model, nnx.Param, ...)[2]

    ref = reference(tx, params, ref_loss, batches, model_state=rest)
    state = jzero.nnx.TrainState.create(
        NNXConvNet("batch", nnx.Rngs(0)), tx=tx, mesh=jzero.data_mesh(), stage=2
    )
    state, _ = state.train_step(nnx_loss, axis_name="batch")(state, batches[0])
    model = state.model()
    assert_tree_close(
        nnx.state(model, nnx.BatchStat), nnx.state(ref.model_state), rtol=1e-6, atol=1e-7
    )
    assert_tree_close(nnx.state(model, nnx.Param), ref.params, rtol=1e-5, atol=1e-6)


def collectives_loss(axis: str):
    """Collectives over ``axis`` at the top level and inside jit, scan, cond, while_loop and
    checkpoint: with ``axis='batch'`` aliased, the step must equal the one naming 'data'."""

    def loss_fn(params, batch):
        h_BxD = jnp.tanh(batch["x"] @ jzero.gather(params)["w"])
        h_BxD = h_BxD - jax.lax.pmean(h_BxD.mean(0), axis)
        gathered = jax.lax.all_gather(h_BxD.sum(0), axis).sum(0)
        index = jax.lax.axis_index(axis).astype(jnp.float32)

        def row(carry, h_D):
            return carry + jax.lax.psum(h_D.sum(), axis), jax.lax.pmean(h_D, axis)

        carry, rows = jax.lax.scan(row, h_BxD.sum() * 0, h_BxD)
        jitted = jax.jit(lambda a: jax.lax.pmean(a * 2, axis))(h_BxD)
        remat = jax.checkpoint(lambda a: jnp.sin(jax.lax.psum(a, axis)))(h_BxD)
        branch = jax.lax.cond(
            carry > 0, lambda a: jax.lax.pmean(a, axis), lambda a: jax.lax.pmean(-a, axis), h_BxD
        )
        count = jax.lax.while_loop(lambda c: c < jax.lax.psum(1.0, axis), lambda c: c + 1.0, 0.0)
        terms = (h_BxD**2).sum() + 1e-3 * gathered.sum() + 1e-2 * (carry + rows.sum())
        return terms + jitted.sum() + remat.sum() + branch.sum() + 1e-3 * (index + count)

    return loss_fn


@pytest.mark.parametrize("mesh", ["data", "hybrid"])
def test_aliased_collectives_equal_the_same_collectives_over_data(mesh):
    mesh = jzero.data_mesh() if mesh == "data" else jzero.hybrid_mesh(2)
    batch_axes = "data" if "replica" not in mesh.axis_names else ("replica", "data")
    params = {"w": jax.random.normal(jax.random.key(0), (5, 4), jnp.float32)}
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 5), jnp.float32)}
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=3)
    want_state, want = opt.train_step(collectives_loss(batch_axes))(opt.init(params), batch)
    got_state, got = opt.train_step(collectives_loss("batch"), axis_name="batch")(
        opt.init(params), batch
    )
    assert float(got["loss"]) == float(want["loss"])
    np.testing.assert_array_equal(opt.full_params(got_state)["w"], opt.full_params(want_state)["w"])


def test_a_foreign_axis_name_is_named_with_the_fix():
    variables = ConvNet().init(jax.random.key(0), image_batches(1)[0]["x"][:2])
    state = jzero.linen.TrainState.create(
        apply_fn=ConvNet().apply, variables=variables, tx=make_tx(), mesh=jzero.data_mesh(), stage=0
    )
    with pytest.raises(ValueError, match=r"pmean over axis 'batch'.*axis_name='batch'"):
        state.train_step(linen_loss(ConvNet()), donate=False)(state, image_batches(1)[0])


def test_an_axis_neither_in_the_mesh_nor_aliased_is_named():
    params = {"w": jnp.ones((5, 4), jnp.float32)}
    batch = {"x": jnp.ones((16, 5), jnp.float32)}

    def loss_fn(params, batch):
        h_BxD = batch["x"] @ jzero.gather(params)["w"]
        h_BxD = h_BxD - jax.lax.pmean(h_BxD.mean(0), "batch")
        return jax.lax.all_gather(h_BxD.sum(), "devices").sum()

    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=1)
    step = opt.train_step(loss_fn, axis_name="batch", donate=False)
    with pytest.raises(ValueError, match=r"all_gather over axis 'devices'.*\('data', 'batch'\)"):
        step(opt.init(params), batch)


def test_axis_name_must_be_a_new_name():
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=0)
    with pytest.raises(ValueError, match=r"axis_name='data' is already an axis of the mesh"):
        opt.train_step(lambda p, b: 0.0, axis_name="data")
    with pytest.raises(TypeError, match=r"axis_name must be a str or a tuple of str"):
        opt.train_step(lambda p, b: 0.0, axis_name=3)
