"""Optimizer-state leaves take the layout of the parameter they belong to, as Optax says
(``optax.tree_map_params``), not of whichever parameter has their shape: two same-shaped
parameters with different specs over ``'model'`` keep their moments split like themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jzero

SPECS = {"a": P(None, "model"), "b": P("model")}  # same shape, different specs


def _params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {name: jax.random.normal(k, (8, 16)) for name, k in zip(SPECS, keys)}


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["a"].T @ params["b"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adam_moments_are_split_like_their_own_parameter(stage):
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), _mesh(), stage=stage, param_specs=SPECS)
    plan = opt.plan(_params())
    names = ["a", "b"]  # the params' flattening order
    user = {n: plan.params[i].layout.user_spec for i, n in enumerate(names)}
    assert user == SPECS
    # adam's state: (ScaleByAdamState(count, mu, nu), EmptyState()); mu and nu per param
    moments = [s.layout.user_spec for s in plan.opt if s.layout.shape == (8, 16)]
    assert moments == [SPECS["a"], SPECS["b"], SPECS["a"], SPECS["b"]]
    state = opt.init(_params())
    mu = state.opt_state[0].mu
    for name in names:
        spec = mu[name].sharding.spec
        own = [
            i for i, e in enumerate(spec) if e == "model" or (isinstance(e, tuple) and "model" in e)
        ]
        want = [i for i, e in enumerate(SPECS[name]) if e == "model"]
        assert own == want, (name, spec)


def test_the_moments_train_as_single_device_optax():
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), _mesh(), stage=1, param_specs=SPECS)
    state = opt.init(_params())
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 16)), "y": jnp.ones((8, 16))}
    step = opt.train_step(_loss)
    tx, params = optax.adam(1e-2), _params()
    ref_state = tx.init(params)
    for _ in range(3):
        state, metrics = step(state, batch)
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, ref_state = tx.update(grads, ref_state, params)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    got = opt.full_params(state)
    for name in SPECS:
        np.testing.assert_allclose(got[name], params[name], rtol=1e-6, atol=1e-7)


def test_state_optax_cannot_attribute_falls_back_to_shapes():
    """An init that reads its parameters' values defeats tree_map_params: the plan then
    matches by shape, where only one parameter has that shape."""

    def init(params):
        scale = jax.tree.map(lambda p: jnp.zeros_like(p) + jnp.sum(p) * 0, params)
        return {"scale": scale}

    tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    params = {"a": jnp.ones((8, 16)), "c": jnp.ones((4, 16))}
    specs = {"a": P(None, "model"), "c": P()}
    opt = jzero.ZeroOptimizer(tx, _mesh(), stage=1, param_specs=specs)
    plan = opt.plan(params)
    assert [s.layout.user_spec for s in plan.opt] == [P(None, "model"), P()]
