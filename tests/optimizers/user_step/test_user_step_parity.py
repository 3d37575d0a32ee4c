"""ZeRO inside the user's own step gives single-device Optax's numbers: ``jzero.shard_optimizer``
in a plain ``jax.jit`` step (12 transformations) and ``jzero.nnx.Optimizer`` in an ``nnx.jit``
step (10), at stages 1-3, on 8 CPU devices; and a Linen ``TrainState`` unchanged.

The tolerance is jzero's own step's (``tests/core/test_parity.py``): fp32, each of 5 steps
from the same state (``_models.assert_each_step_is_optax``, ``STEP_RTOL`` and
``STEP_ATOL``). The compiler sums the 8 devices' gradients in another order than the
single-device reference, which moves elements by a few ulps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import (
    OPTIMIZERS,
    STEP_ATOL,
    STEP_RTOL,
    assert_each_step_is_optax,
    assert_tree_close,
    awkward_batches,
    awkward_loss,
    awkward_params,
    record,
    reference,
)
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero

RTOL, ATOL = 1e-6, 1e-6
STEPS = 5
# Transformations whose masks and labels read no parameter names (the NNX model's differ).
NNX_OPTIMIZERS = sorted(set(OPTIMIZERS) - {"masked", "multi_transform_frozen"})


def _on_data(batch, mesh):
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def user_jit_step(tx, params, mesh, stage):
    """The step a user writes with Optax, ``jzero.shard_optimizer`` in ``tx``'s place, and
    its first state: ``step((params, opt_state), batch) -> ((params, opt_state), loss)``."""
    sharded = jzero.shard_optimizer(tx, mesh, stage=stage)
    if stage == 3:
        params = jzero.shard_params(params, mesh)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(awkward_loss)(params, batch)
        updates, opt_state = sharded.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return lambda state, batch: step(state, _on_data(batch, mesh)), (params, sharded.init(params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_jit_step_with_shard_optimizer_matches_single_device_optax(stage, name):
    mesh = jzero.data_mesh()
    step, state = user_jit_step(OPTIMIZERS[name](), awkward_params(), mesh, stage)
    batches = awkward_batches(STEPS)
    (params, _), trajectory = record(step, state, lambda state: state, batches)
    assert_each_step_is_optax(OPTIMIZERS[name](), awkward_loss, trajectory, batches)
    # The awkward model's one leaf that 8 divides (emb, 40 x 13) rests sharded, and its
    # optimizer-state twins with it; the others stay whole.
    rest = lambda x: x.sharding.spec
    assert rest(params["emb"]) == (P("data") if stage == 3 else P())
    assert rest(params["w1"]) == P()


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(40, 16, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _nnx_step(put):
    """The step a user writes with NNX: ``step(model, optimizer, batch) -> loss``."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    return lambda model, optimizer, batch: float(step(model, optimizer, put(batch)))


def _take(target, state, *filters):
    """``target`` (an NNX object on one device) given ``state``'s values, gathered whole."""
    own = nnx.state(target, *filters)
    values = jax.device_put(jax.tree.leaves(state), jax.devices()[0])
    nnx.update(target, jax.tree.unflatten(jax.tree.structure(own), values))


# Each transformation once, at stages 1, 2, 3 in turn (the plain jit step above runs the
# whole grid; what nnx adds, the wrapper and its placement, is the same at every stage).
@pytest.mark.parametrize(
    ("stage", "name"), [((1, 2, 3)[i % 3], name) for i, name in enumerate(NNX_OPTIMIZERS)]
)
def test_an_nnx_jit_step_with_jzero_optimizer_matches_nnx_optimizer(stage, name):
    mesh = jzero.data_mesh()
    ref_model, model = Mlp(nnx.Rngs(0)), Mlp(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, OPTIMIZERS[name](), wrt=nnx.Param)
    opt = jzero.nnx.Optimizer(model, OPTIMIZERS[name](), wrt=nnx.Param, mesh=mesh, stage=stage)
    ref_step = _nnx_step(lambda batch: jax.device_put(batch, jax.devices()[0]))
    step = _nnx_step(lambda batch: _on_data(batch, mesh))
    tol = {"rtol": STEP_RTOL, "atol": STEP_ATOL}
    assert_tree_close(nnx.state(opt), nnx.state(ref_opt), **tol)
    # Each step from the same state (as _models.assert_each_step_is_optax): nnx.Optimizer
    # takes jzero's, gathered, before each; rounding cannot accumulate.
    for batch in awkward_batches(STEPS):
        _take(ref_model, nnx.state(model, nnx.Param), nnx.Param)
        _take(ref_opt, nnx.state(opt))
        want = ref_step(ref_model, ref_opt, batch)
        assert step(model, opt, batch) == pytest.approx(want, rel=STEP_RTOL, abs=STEP_ATOL)
        assert_tree_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), **tol)
        assert_tree_close(nnx.state(opt), nnx.state(ref_opt), **tol)
    # hidden's kernel (40 x 16) rests sharded along its output dimension at stage 3; the
    # optimizer's state is sharded at every stage, every leaf with a dimension 8 divides.
    kernel = model.hidden.kernel[...]
    assert kernel.sharding.spec == (P(None, "data") if stage == 3 else P())
    leaves = jax.tree.leaves(nnx.state(opt.opt_state))
    divisible = [x for x in leaves if any(d % 8 == 0 for d in x.shape)]
    assert divisible and all("data" in x.sharding.spec for x in divisible)


@pytest.mark.parametrize("stage", [1, 2, pytest.param(3, marks=pytest.mark.smoke)])
def test_a_linen_train_state_takes_shard_optimizer_unchanged(stage):
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(jnp.tanh(nn.Dense(16)(x)))

    mesh, batches, model = jzero.data_mesh(), awkward_batches(STEPS), Model()
    params = model.init(jax.random.key(0), batches[0]["x"])["params"]
    loss = lambda p, batch: jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
    want = reference(optax.adamw(1e-2, weight_decay=0.1), params, loss, batches)
    if stage == 3:
        params = jzero.shard_params(params, mesh)
    tx = jzero.shard_optimizer(optax.adamw(1e-2, weight_decay=0.1), mesh, stage=stage)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def step(state, batch):
        grads = jax.grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads)

    for batch in batches:
        state = step(state, _on_data(batch, mesh))
    assert_tree_close(state.params, want.params, rtol=RTOL, atol=ATOL)
    assert_tree_close(state.opt_state, want.opt_state, rtol=RTOL, atol=ATOL)
    kernel = state.params["Dense_1"]["kernel"]  # 40 x 16 (Dense_0 is the outer call, 16 x 5)
    assert kernel.sharding.spec == (P(None, "data") if stage == 3 else P())
    assert state.opt_state[0].mu["Dense_1"]["kernel"].sharding.spec == P(None, "data")
