"""ZeRO inside the user's own step gives single-device Optax's numbers: ``jzero.shard_optimizer``
in a plain ``jax.jit`` step (12 transformations) and ``jzero.nnx.Optimizer`` in an ``nnx.jit``
step (10), at stages 1-3, on 8 CPU devices; and a Linen ``TrainState`` unchanged.

The tolerance is jzero's own step's (``tests/core/test_parity.py``): fp32, 5 steps, rtol and
atol 1e-6 (5e-6 for Nesterov momentum). The compiler sums the 8 devices' gradients in
another order than the single-device reference, which moves elements by a few ulps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import (
    OPTIMIZERS,
    PARITY_ATOLS,
    assert_tree_close,
    awkward_batches,
    awkward_loss,
    awkward_params,
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


def user_jit_run(tx, params, batches, mesh, stage):
    """The step a user writes with Optax, ``jzero.shard_optimizer`` in ``tx``'s place."""
    sharded = jzero.shard_optimizer(tx, mesh, stage=stage)
    if stage == 3:
        params = jzero.shard_params(params, mesh)
    opt_state = sharded.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(awkward_loss)(params, batch)
        updates, opt_state = sharded.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, _on_data(batch, mesh))
        losses.append(float(loss))
    return params, opt_state, losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_jit_step_with_shard_optimizer_matches_single_device_optax(stage, name):
    params, batches, mesh = awkward_params(), awkward_batches(STEPS), jzero.data_mesh()
    want = reference(OPTIMIZERS[name](), params, awkward_loss, batches)
    got_params, got_state, losses = user_jit_run(OPTIMIZERS[name](), params, batches, mesh, stage)
    atol = PARITY_ATOLS.get(name, ATOL)
    assert losses == pytest.approx(want.losses, rel=RTOL, abs=atol)
    assert_tree_close(got_params, want.params, rtol=RTOL, atol=atol)
    assert jax.tree.structure(got_state) == jax.tree.structure(want.opt_state)
    assert_tree_close(got_state, want.opt_state, rtol=RTOL, atol=atol)
    # The awkward model's one leaf that 8 divides (emb, 40 x 13) rests sharded, and its
    # optimizer-state twins with it; the others stay whole.
    rest = lambda x: x.sharding.spec
    assert rest(got_params["emb"]) == (P("data") if stage == 3 else P())
    assert rest(got_params["w1"]) == P()


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(40, 16, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _nnx_run(model, optimizer, batches, put):
    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, put(batch))) for batch in batches]


# Each transformation once, at stages 1, 2, 3 in turn (the plain jit step above runs the
# whole grid; what nnx adds, the wrapper and its placement, is the same at every stage).
@pytest.mark.parametrize(
    ("stage", "name"), [((1, 2, 3)[i % 3], name) for i, name in enumerate(NNX_OPTIMIZERS)]
)
def test_an_nnx_jit_step_with_jzero_optimizer_matches_nnx_optimizer(stage, name):
    mesh, batches = jzero.data_mesh(), awkward_batches(STEPS)
    ref_model, model = Mlp(nnx.Rngs(0)), Mlp(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, OPTIMIZERS[name](), wrt=nnx.Param)
    opt = jzero.nnx.Optimizer(model, OPTIMIZERS[name](), wrt=nnx.Param, mesh=mesh, stage=stage)
    single = lambda batch: jax.device_put(batch, jax.devices()[0])
    want = _nnx_run(ref_model, ref_opt, batches, single)
    got = _nnx_run(model, opt, batches, lambda batch: _on_data(batch, mesh))
    atol = PARITY_ATOLS.get(name, ATOL)
    assert got == pytest.approx(want, rel=RTOL, abs=atol)
    assert_tree_close(
        nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=RTOL, atol=atol
    )
    assert_tree_close(nnx.state(opt), nnx.state(ref_opt), rtol=RTOL, atol=atol)
    # hidden's kernel (40 x 16) rests sharded along its output dimension at stage 3; the
    # optimizer's state is sharded at every stage, every leaf with a dimension 8 divides.
    kernel = model.hidden.kernel[...]
    assert kernel.sharding.spec == (P(None, "data") if stage == 3 else P())
    leaves = jax.tree.leaves(nnx.state(opt.opt_state))
    divisible = [x for x in leaves if any(d % 8 == 0 for d in x.shape)]
    assert divisible and all("data" in x.sharding.spec for x in divisible)


@pytest.mark.parametrize("stage", [1, 2, 3])
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
