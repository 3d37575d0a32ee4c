"""ZeRO-Offload's delayed parameter update (``Offload(optimizer="host", delay=1)``), on 8
CPU devices: after ``exact_steps`` exact steps, each step applies the gradient the step
before it took, so the host's update never waits for this step's backward pass.

The oracle is single-device Optax run the same way by hand: the gradient of batch k is
taken at the parameters step k starts from, and applied at step k + 1 (none at the first
delayed step). fp32 agrees to rounding (rtol 1e-6).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import assert_tree_close, awkward_batches, awkward_loss, awkward_params
from _offload import HOST, TXS

import jzero

STEPS = 6
BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)


def _delayed(exact_steps: int, ratio: float = 1.0) -> jzero.Offload:
    return jzero.Offload(optimizer="host", delay=1, exact_steps=exact_steps, ratio=ratio)


def _opt(tx: str, offload, *, stage: int, precision=None) -> jzero.ZeroOptimizer:
    return jzero.ZeroOptimizer(
        TXS[tx], jzero.data_mesh(), stage=stage, min_shard_size=1, offload=offload,
        precision=precision,
    )  # fmt: skip


def stale_reference(tx: optax.GradientTransformation, exact_steps: int, steps: int = STEPS):
    """Single-device Optax with the delay written out: (params, opt_state, losses)."""
    params, pending, losses = awkward_params(), None, []
    opt_state = tx.init(params)
    for k, batch in enumerate(awkward_batches(steps)):
        loss, grads = jax.value_and_grad(awkward_loss)(params, batch)
        losses.append(float(loss))
        if k >= exact_steps:  # apply the gradient held from the step before, hold this one
            grads, pending = pending, grads
        if grads is not None:
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    return params, opt_state, losses


@functools.cache
def _run(stage: int, tx: str, offload, precision=None, steps: int = STEPS):
    """The optimizer, its state after each step, and the losses."""
    opt = _opt(tx, offload, stage=stage, precision=precision)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss, donate=False)
    states, losses = [], []
    for batch in awkward_batches(steps):
        state, metrics = step(state, batch)
        states.append(opt.full_state(state))
        losses.append(float(metrics["loss"]))
    return opt, states, losses


@pytest.mark.parametrize(
    ("stage", "tx", "ratio"),
    [
        (3, "adam", 1.0),
        (2, "clip_adamw", 1.0),
        (1, "adam", 1.0),
        (2, "adam", 0.8),  # w1, w2 and s on the device: the delay holds there too
        pytest.param(3, "clip_adamw", 0.8, marks=pytest.mark.slow),
    ],
)
def test_the_delayed_update_equals_its_stale_gradient_reference(stage, tx, ratio):
    _, states, losses = _run(stage, tx, _delayed(2, ratio))
    params, opt_state, ref_losses = stale_reference(TXS[tx], exact_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_tree_close(states[-1].params, params, rtol=1e-6, atol=1e-6)
    assert_tree_close(states[-1].opt_state, opt_state, rtol=1e-6, atol=1e-6)


def test_the_first_delayed_step_applies_nothing_and_holds_its_gradient():
    _, states, _ = _run(3, "adam", _delayed(2))
    applied = [bool(s.pending.apply) for s in states]
    assert applied == [False, False, True, True, True, True]  # exact, exact, then held
    for got, want in zip(jax.tree.leaves(states[2].params), jax.tree.leaves(states[1].params)):
        np.testing.assert_array_equal(got, want)  # step 3 had no earlier gradient
    assert [int(s.step) for s in states] == list(range(1, STEPS + 1))


def test_before_the_delay_starts_the_steps_are_the_exact_host_steps_bitwise():
    _, delayed, delayed_losses = _run(2, "adam", _delayed(STEPS))
    _, exact, exact_losses = _run(2, "adam", jzero.Offload(optimizer="host"))
    assert delayed_losses == exact_losses
    for got, want in zip(
        jax.tree.leaves((delayed[-1].params, delayed[-1].opt_state)),
        jax.tree.leaves((exact[-1].params, exact[-1].opt_state)),
    ):
        np.testing.assert_array_equal(got, want)


def test_the_held_gradient_rests_in_host_memory_as_reduced():
    opt = _opt("adam", _delayed(0), stage=3, precision=BF16)
    state = opt.init(awkward_params())
    state, _ = opt.train_step(awkward_loss)(state, awkward_batches(1)[0])
    held = jax.tree.leaves(state.pending.grads)
    assert {x.sharding.memory_kind for x in held} == {HOST}
    assert {x.dtype for x in held} == {jnp.dtype(jnp.bfloat16)}  # the reduce dtype
    for x, master in zip(held, jax.tree.leaves(state.master)):  # sharded like the state
        assert x.sharding.spec == master.sharding.spec and x.shape == master.shape
    assert bool(state.pending.apply) and state.pending.denominator.shape == ()


def test_a_checkpoint_holds_the_gradient_and_resumes_bitwise(tmp_path):
    opt = _opt("adam", _delayed(1), stage=3, precision=BF16)
    batches = awkward_batches(5)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss, donate=False)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    ckpt = jzero.Checkpointer(tmp_path)
    ckpt.save(3, state, force=True)
    ckpt.wait()
    restored = ckpt.restore(opt, awkward_params()).state
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(jax.device_get(got)), jax.device_get(want))
    resumed = opt.train_step(awkward_loss)  # a new step reads the restored state's count
    for batch in batches[3:]:
        state, _ = step(state, batch)
        restored, _ = resumed(restored, batch)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(jax.device_get(got)), jax.device_get(want))
    plain = _opt("adam", jzero.Offload(optimizer="host"), stage=3, precision=BF16)
    with pytest.warns(UserWarning, match=r"that one step's gradient is not applied"):
        assert ckpt.restore(plain, awkward_params()).state.pending is None
    ckpt.close()


def test_a_checkpoint_without_a_held_gradient_starts_the_delay_afresh(tmp_path):
    plain = _opt("adam", jzero.Offload(optimizer="host"), stage=2)
    state = plain.init(awkward_params())
    ckpt = jzero.Checkpointer(tmp_path)
    ckpt.save(0, state, force=True)
    ckpt.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        restored = ckpt.restore(_opt("adam", _delayed(0), stage=2), awkward_params()).state
    ckpt.close()
    assert not bool(restored.pending.apply)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(restored.pending.grads))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"optimizer": "host", "delay": 2}, r"Offload\.delay must be 0 \(every step exact\) or 1"),
        ({"optimizer": "host", "delay": True}, r"Offload\.delay must be 0"),
        ({"optimizer": "stream", "delay": 1}, r"optimizer='stream' does not update on the host"),
        ({"delay": 1}, r"optimizer=None does not update on the host; pass optimizer='host'"),
        ({"optimizer": "host", "delay": 1, "exact_steps": -1}, r"exact_steps must be an int >= 0"),
        ({"optimizer": "host", "exact_steps": 5}, r"delay=0 delays nothing; pass delay=1"),
    ],
)
def test_delay_options_are_checked_with_the_fix(kwargs, error):
    with pytest.raises(ValueError, match=error):
        jzero.Offload(**kwargs)


def test_a_delay_with_dynamic_loss_scaling_is_refused():
    fp16 = jzero.Precision(param_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"dynamic loss scaling .* use bf16 or fp32 parameters"):
        _opt("adam", _delayed(0), stage=2, precision=fp16)


def test_a_weighted_loss_with_a_delay_is_refused_when_traced():
    opt = _opt("adam", _delayed(0), stage=2)

    def weighted(params, batch):
        return jzero.Weighted(awkward_loss(params, batch) * 16, jnp.float32(16))

    with pytest.raises(ValueError, match=r"jzero\.Weighted loss.*Offload\(delay=1\)"):
        opt.train_step(weighted)(opt.init(awkward_params()), awkward_batches(1)[0])


def test_the_delay_on_an_explicit_mesh_with_accumulation_equals_the_auto_mesh_bitwise():
    """Where the delay meets other features: ``jax.make_mesh`` 's Explicit axes and
    gradient accumulation, bf16 with fp32 master weights, stage 3."""
    finals = []
    for mesh in (jzero.data_mesh(), jax.make_mesh((8,), ("data",))):
        opt = jzero.ZeroOptimizer(
            TXS["clip_adamw"], mesh, stage=3, min_shard_size=1, precision=BF16,
            offload=_delayed(1),
        )  # fmt: skip
        state, step = opt.init(awkward_params()), opt.train_step(awkward_loss, grad_accum=2)
        for batch in awkward_batches(4):
            state, _ = step(state, batch)
        finals.append(opt.full_state(state))
    for got, want in zip(jax.tree.leaves(finals[1]), jax.tree.leaves(finals[0])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
