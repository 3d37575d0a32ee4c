"""Mixed precision: bf16/fp16 parameters, fp32 master weights, reduce dtype, loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params, reference

import jzero

N = 8
BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def _train(stage, precision, batches, tx=None):
    tx = optax.adam(1e-2) if tx is None else tx
    opt = jzero.ZeroOptimizer(
        tx, jzero.data_mesh(), stage=stage, min_shard_size=1, precision=precision
    )
    state = opt.init(awkward_params())
    step = opt.train_step(awkward_loss)
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(metrics)
    return opt, state, history


def test_bf16_with_fp32_master_tracks_fp32_reference():
    batches = awkward_batches(5)
    ref_params, _, ref_losses, _ = reference(
        optax.adam(1e-2), awkward_params(), awkward_loss, batches
    )
    results = [_train(stage, BF16, batches) for stage in (0, 1, 2, 3)]
    for opt, state, history in results:
        # bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per operation) and the
        # forward/backward runs in bf16: losses agree with fp32 to 1e-2 relative. Adam
        # normalises each gradient element, so where a gradient is small its bf16 rounding
        # can flip an update's size by up to lr per step: after 5 steps of lr 1e-2 the fp32
        # master weights agree with the fp32 run to 3e-2 absolute (measured: 2.4e-2).
        np.testing.assert_allclose([m["loss"] for m in history], ref_losses, rtol=1e-2)
        master = opt.full_state(state).master
        for k in ref_params:
            assert master[k].dtype == jnp.float32
            np.testing.assert_allclose(master[k], ref_params[k], atol=3e-2, err_msg=k)
        # The parameters the model computes with are the master weights cast to bf16.
        full = opt.full_params(state)
        for k in ref_params:
            assert full[k].dtype == jnp.bfloat16
            np.testing.assert_array_equal(full[k], master[k].astype(jnp.bfloat16))
    # Between stages only the reduction order differs (fp32 sums of bf16 gradients): fp32
    # rounding, which Adam's normalisation can grow to a few 1e-6 on small gradients.
    stage0 = results[0][0].full_state(results[0][1]).master
    for opt, state, _ in results[1:]:
        master = opt.full_state(state).master
        for k in stage0:
            np.testing.assert_allclose(master[k], stage0[k], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_2_2_k(stage):
    # Ψ parameters (all leaves divide 8: no padding), Adam: K = 4 (master) + 8 (moments).
    params = {"w": jnp.ones((64, 128), jnp.float32), "v": jnp.ones((32, 64), jnp.float32)}
    psi = sum(x.size for x in params.values())
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=stage, precision=BF16)
    state = opt.init(params)
    per_device = lambda tree: sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
    )
    assert per_device(state.params) == (2 * psi // N if stage == 3 else 2 * psi)
    k_bytes = per_device(state.master) + per_device(state.opt_state) - 4  # Adam's int32 count
    assert k_bytes == (12 * psi if stage == 0 else 12 * psi // N)


def test_collective_dtypes_follow_the_policy():
    params = {"w": jnp.ones((64, 128), jnp.float32)}
    loss = lambda p, b: jnp.mean((b["x"] @ jzero.gather(p)["w"]).astype(jnp.float32) ** 2)
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=3, precision=BF16)
    state = opt.init(params)
    lowered = opt.train_step(loss).lower(state, {"x": jnp.ones((8, 64), jnp.bfloat16)})
    # The HLO jzero emits, before XLA:CPU's passes (which run 16-bit collectives in f32).
    text = lowered.compiler_ir(dialect="hlo").as_hlo_text()
    gathers = [ln for ln in text.splitlines() if " all-gather(" in ln]
    scatters = [ln for ln in text.splitlines() if " reduce-scatter(" in ln]
    assert gathers and all("= bf16[64,128]" in ln for ln in gathers)  # gather in bf16
    assert scatters and all("= f32[64,16]" in ln for ln in scatters)  # reduce in fp32


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_loss_scaling_skips_an_overflowing_step_on_every_device(stage):
    fp16 = jzero.Precision(param_dtype=jnp.float16, initial_loss_scale=2.0**10)
    assert fp16.dynamic_loss_scale
    good, bad = awkward_batches(2)
    bad = {"x": (bad["x"] * 1e4).astype(jnp.float16), "y": bad["y"]}  # overflows fp16
    opt, state, history = _train(stage, fp16, [good, bad, good])
    first, overflow, after = history
    assert int(first["skipped"]) == 0 and int(overflow["skipped"]) == 1
    assert float(overflow["loss_scale"]) == 2.0**10 and float(after["loss_scale"]) == 2.0**9
    assert int(after["skipped"]) == 0 and int(state.step) == 3
    # The skipped step changed nothing: replaying only the good steps gives the same state.
    _, ref_state, _ = _train(stage, fp16, [good, good])
    for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(ref_state.master)):
        np.testing.assert_array_equal(a, b)
    for x in jax.tree.leaves(state.params):  # one value on every device
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        if x.sharding.is_fully_replicated:
            assert all(np.array_equal(shards[0], s) for s in shards[1:])
        assert all(np.isfinite(s).all() for s in shards)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float64, "complex64", "not-a-dtype"])
def test_dtype_the_policy_cannot_use(dtype):
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        jzero.Precision(param_dtype=dtype)
    with pytest.raises(ValueError, match="reduce_dtype must be float32, bfloat16 or float16"):
        jzero.Precision(reduce_dtype=dtype)
