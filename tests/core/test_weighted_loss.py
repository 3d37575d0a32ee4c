"""Token-weighted losses (``jzero.Weighted``): with unequal token counts per device and per
micro-batch, loss and gradients are those of sum / count over the global batch."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, reference
from flax import nnx

import jzero

B, T, D, H = 16, 6, 5, 7  # 16 rows: 2 per device on 8 devices, 1 per micro-batch at k=2


def token_params(seed: int = 0) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (D, H), jnp.float32) * 0.5,
        "w2": jax.random.normal(k2, (H,), jnp.float32) * 0.5,
    }


def token_batches(steps: int) -> list[dict[str, jax.Array]]:
    """Row r keeps its first (r * 5) % (T + 1) tokens: 0 to T real tokens per row, so
    devices (2 rows each) and micro-batches (1 row each) hold different numbers, and
    one row holds none."""
    lengths_B = (np.arange(B) * 5) % (T + 1)
    mask_BxT = (np.arange(T)[None, :] < lengths_B[:, None]).astype(np.float32)
    out = []
    for i in range(steps):
        kx, ky = jax.random.split(jax.random.key(100 + i))
        out.append(
            {
                "x": jax.random.normal(kx, (B, T, D), jnp.float32),
                "y": jax.random.normal(ky, (B, T), jnp.float32),
                "mask": jnp.asarray(mask_BxT),
            }
        )
    return out


def token_errors(params, batch):
    params = jzero.gather(params)
    pred_BxT = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return (pred_BxT - batch["y"]) ** 2


def weighted_loss(params, batch):
    err_BxT, mask_BxT = token_errors(params, batch), batch["mask"]
    return jzero.Weighted(total=(err_BxT * mask_BxT).sum(), count=mask_BxT.sum())


def global_mean_loss(params, batch):
    """The single-device objective: sum over the global batch's tokens / their number."""
    return (token_errors(params, batch) * batch["mask"]).sum() / batch["mask"].sum()


def test_token_counts_differ_across_devices_and_micro_batches():
    mask_BxT = token_batches(1)[0]["mask"]
    per_device = mask_BxT.reshape(8, -1).sum(1)
    per_row = mask_BxT.sum(1)
    assert len(set(per_device.tolist())) > 1 and len(set(per_row.tolist())) > 1
    assert 0 in per_row.tolist()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_weighted_loss_matches_single_device_sum_over_count(stage, grad_accum):
    tx, params, batches = optax.sgd(0.5), token_params(), token_batches(3)
    ref = reference(tx, params, global_mean_loss, batches)

    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage)
    state = opt.init(params)
    step = opt.train_step(weighted_loss, grad_accum=grad_accum)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    # SGD: the parameters are the gradients' running sum, so this compares gradients.
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6)
    assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=1e-7)


def test_weighted_loss_on_a_hybrid_mesh_with_aux():
    tx, params, batches = optax.sgd(0.5), token_params(), token_batches(2)
    ref = reference(tx, params, global_mean_loss, batches)

    def loss_fn(params, batch):
        w = weighted_loss(params, batch)
        return w, {"tokens": batch["mask"].sum().astype(jnp.int32)}

    opt = jzero.ZeroOptimizer(tx, jzero.hybrid_mesh(2), stage=2)
    state = opt.init(params)
    step = opt.train_step(loss_fn, has_aux=True, grad_accum=2)
    for batch, want in zip(batches, ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
        assert int(metrics["aux"]["tokens"]) == int(batch["mask"].sum())
    assert_tree_close(opt.full_params(state), ref.params, rtol=1e-6, atol=1e-7)


def test_the_mean_of_device_means_is_a_different_objective():
    """The plain path (each device's mean, averaged) stays as it was, and is not sum/count
    here: the reason for Weighted."""
    batch = token_batches(1)[0]

    def device_mean(params, batch):
        mask_BxT = batch["mask"]
        return (token_errors(params, batch) * mask_BxT).sum() / jnp.maximum(mask_BxT.sum(), 1)

    opt = jzero.ZeroOptimizer(optax.sgd(0.5), jzero.data_mesh(), stage=0)
    state = opt.init(token_params())
    _, metrics = opt.train_step(device_mean)(state, batch)
    rows = B // 8
    means = [
        device_mean(token_params(), {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()})
        for i in range(8)
    ]
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(means), rtol=1e-6)
    assert abs(float(metrics["loss"]) - float(global_mean_loss(token_params(), batch))) > 1e-3


def test_zero_tokens_in_the_global_batch_give_zero_loss_and_gradients():
    batch = token_batches(1)[0]
    batch["mask"] = jnp.zeros_like(batch["mask"])
    opt = jzero.ZeroOptimizer(optax.sgd(0.5), jzero.data_mesh(), stage=3)
    state = opt.init(token_params())
    step = opt.train_step(weighted_loss)
    state, metrics = step(state, batch)
    assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
    # A count of 0 is valid (taken as 1): not skipped, and the next call does not raise.
    assert float(metrics["count"]) == 0.0 and int(metrics["skipped"]) == 0
    assert int(state.step) == 1
    jax.block_until_ready(metrics)
    state, metrics = step(state, batch)
    assert int(state.step) == 2 and int(metrics["skipped"]) == 0


FP16 = jzero.Precision(param_dtype=jnp.float16, initial_loss_scale=2.0**10)


def bad_count_loss(kind):
    """``weighted_loss`` with a count that is negative (float or int) or NaN."""

    def loss_fn(params, model_state, batch):
        w = weighted_loss(params, batch)
        count = {
            "negative": -w.count,
            "negative int": -w.count.astype(jnp.int32),
            "nan": w.count * jnp.nan,
        }[kind]
        bad = batch["bad"][0] > 0  # the same on every row: one batch is bad, the others not
        count = jnp.where(bad, count, w.count.astype(count.dtype))
        return jzero.Weighted(w.total, count), {"calls": model_state["calls"] + 1}

    return loss_fn


def flagged(batch, bad):
    return batch | {"bad": jnp.full((B,), float(bad), jnp.float32)}


def snapshot(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize(
    "stage, grad_accum, kind, options",
    [
        (0, 1, "negative int", {}),
        (3, 2, "negative", {}),
        (2, 1, "nan", {}),
        (1, 1, "negative", {"precision": FP16}),  # loss scaling: the scale stays too
        (2, 1, "negative", {"offload": "optimizer"}),  # Optax state in pinned_host
    ],
)
def test_an_invalid_count_skips_the_step_and_the_next_call_says_so(
    stage, grad_accum, kind, options
):
    """A negative (or NaN) global count would maximise the loss: the step changes nothing
    (parameters, Optax state, master weights, model state, loss scale, step counter),
    metrics show it, and the train step raises at the next call, before running it."""
    good, good2 = [flagged(b, False) for b in token_batches(2)]
    bad = flagged(good, True)
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=stage, **options)
    model_state = {"calls": jnp.zeros((), jnp.int32)}
    step = opt.train_step(bad_count_loss(kind), grad_accum=grad_accum, with_model_state=True)
    state, metrics = step(opt.init(token_params(), model_state=model_state), good)
    tokens = float(good["mask"].sum())
    assert float(metrics["count"]) == tokens and int(metrics["skipped"]) == 0
    before = snapshot(state)

    state, metrics = step(state, bad)
    assert int(metrics["skipped"]) == 1 and np.isnan(float(metrics["loss"]))
    count = float(metrics["count"])
    assert np.isnan(count) if kind == "nan" else count == -tokens
    for x, y in zip(before, snapshot(state)):  # every leaf, bitwise
        np.testing.assert_array_equal(x, y)
    assert int(state.step) == 1 and int(state.model_state["calls"]) == grad_accum  # good's

    jax.block_until_ready(metrics)
    shown = "nan" if kind == "nan" else f"-{tokens:g}" if kind == "negative int" else -tokens
    message = rf"call 2 of this train step had a global jzero.Weighted count of {shown} .*"
    message += r"must be >= 0 and finite.*skipped.*nothing was lost. Fix loss_fn's count"
    with pytest.raises(ValueError, match=message):
        step(state, good2)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # refused before running

    # The loop goes on from the state in hand, exactly as if the bad batch never came.
    state, metrics = step(state, good2)
    assert int(metrics["skipped"]) == 0 and int(state.step) == 2
    replay = opt.train_step(bad_count_loss(kind), grad_accum=grad_accum, with_model_state=True)
    ref, _ = replay(opt.init(token_params(), model_state=model_state), good)
    ref, _ = replay(ref, good2)
    for x, y in zip(snapshot(ref), snapshot(state)):
        np.testing.assert_array_equal(x, y)


def test_bad_weighted_outputs_are_refused():
    opt = jzero.ZeroOptimizer(optax.sgd(0.5), jzero.data_mesh(), stage=0)
    state, batch = opt.init(token_params()), token_batches(1)[0]

    def per_row(params, batch):  # a vector total: not reduced over the device's rows
        err_BxT = token_errors(params, batch) * batch["mask"]
        return jzero.Weighted(err_BxT.sum(1), batch["mask"].sum())

    with pytest.raises(TypeError, match=r"Weighted\(total=...\) must be a floating-point scalar"):
        opt.train_step(per_row, donate=False)(state, batch)
    with pytest.raises(TypeError, match=r"must return a pair \(loss, aux\).*jzero.Weighted alone"):
        opt.train_step(weighted_loss, has_aux=True, donate=False)(state, batch)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x_BxTxD):
        return nn.Dense(1)(jnp.tanh(nn.Dense(H)(x_BxTxD)))[..., 0]


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, 1, rngs=rngs)

    def __call__(self, x_BxTxD):
        return self.out(jnp.tanh(self.hidden(x_BxTxD)))[..., 0]


def _masked(pred_BxT, batch):
    err_BxT = (pred_BxT - batch["y"]) ** 2 * batch["mask"]
    return err_BxT.sum(), batch["mask"].sum()


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_both_flax_adapters_take_a_weighted_loss(adapter):
    tx, batches = optax.sgd(0.5), token_batches(2)
    if adapter == "linen":
        model = LinenNet()
        variables = model.init(jax.random.key(0), batches[0]["x"])
        apply = lambda params, batch: model.apply({"params": params}, batch["x"])
        params = variables["params"]
        state = jzero.linen.TrainState.create(
            apply_fn=model.apply, variables=variables, tx=tx, mesh=jzero.data_mesh(), stage=3
        )
        loss_fn = lambda params, batch: jzero.Weighted(*_masked(apply(params, batch), batch))
        full = lambda state: state.params
    else:
        graphdef, params = nnx.split(NNXNet(nnx.Rngs(0)))
        apply = lambda params, batch: nnx.merge(graphdef, params)(batch["x"])
        state = jzero.nnx.TrainState.create(
            NNXNet(nnx.Rngs(0)), tx=tx, mesh=jzero.data_mesh(), stage=3
        )
        loss_fn = lambda model, batch: jzero.Weighted(*_masked(model(batch["x"]), batch))
        full = lambda state: nnx.state(state.model(), nnx.Param)

    def global_mean(params, batch):
        total, count = _masked(apply(params, batch), batch)
        return total / count

    ref = reference(tx, params, global_mean, batches)
    step = state.train_step(loss_fn, grad_accum=2)
    for batch, want in zip(batches, ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-6)
    assert_tree_close(full(state), ref.params, rtol=1e-6, atol=1e-7)
