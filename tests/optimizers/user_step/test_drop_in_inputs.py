"""What the peers' own tests pass to a drop-in, passed to jzero's: extra arguments that are
functions (L-BFGS's line search), a typed PRNG key in the state (``noisy_sgd``),
``optax.tree_map_params``' placeholder, complex parameters and state, and parameters made
on one device. Each is checked against single-device Optax on the same data.

Tolerances: fp32 parity as ``test_user_step_parity.py`` (rtol 1e-6 on 3 steps; the devices'
gradients are summed in another order); a typed key's noise is drawn from the same key, so
``noisy_sgd`` agrees to the same tolerance.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero

RTOL = ATOL = 1e-6
STEPS = 3
LAYOUT = jzero.Layout(min_shard_size=1)  # every leaf that can be sharded is


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,))}


def _loss(params):
    x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - 0.5) ** 2)


def _placed(params, mesh, stage):
    return jzero.shard_params(params, mesh, stage=stage, layout=LAYOUT)


def _side_by_side(make, stage):
    """``STEPS`` eager updates of ``make()`` sharded at ``stage`` and of ``make()`` alone,
    on the same gradients of :func:`_loss`: (params, state) of each."""
    mesh = jzero.data_mesh()
    tx, ref_tx = jzero.shard_optimizer(make(), mesh, stage=stage, min_shard_size=1), make()
    params = _placed(_params(), mesh, stage)
    state, ref, ref_state = tx.init(params), _params(), ref_tx.init(_params())
    for _ in range(STEPS):
        updates, state = tx.update(jax.grad(_loss)(params), state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update(jax.grad(_loss)(ref), ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
    return (params, state), (ref, ref_state)


def _close(got, want, rtol=RTOL, atol=ATOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_lbfgs_line_search_takes_the_loss_function_as_an_extra_argument(stage, jitted):
    """``update(..., value=, grad=, value_fn=loss)``: the function passes through to the
    wrapped update untouched, as Optax passes it."""
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.lbfgs(), mesh, stage=stage, min_shard_size=1)

    def step(tx, params, state):
        value, grad = jax.value_and_grad(_loss)(params)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=_loss)
        return optax.apply_updates(params, updates), state

    sharded = jax.jit(step, static_argnums=0) if jitted else step
    params = _placed(_params(), mesh, stage)
    state = tx.init(params)
    ref_tx = optax.lbfgs()
    ref, ref_state = _params(), ref_tx.init(_params())
    for _ in range(STEPS):
        params, state = sharded(tx, params, state)
        ref, ref_state = step(ref_tx, ref, ref_state)
    _close(params, ref, rtol=1e-5, atol=1e-6)  # a line search: a few ulps move its steps


def test_a_passed_function_does_not_retrace_the_update():
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.lbfgs(), mesh, stage=2)
    params = _params()
    state = tx.init(params)
    traces = []

    def counted(p):
        traces.append(1)
        return _loss(p)

    seen = []
    for _ in range(3):
        value, grad = jax.value_and_grad(_loss)(params)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=counted)
        params = optax.apply_updates(params, updates)
        seen.append(len(traces))
    # traced again only where the state's types settle after the first update
    assert seen[0] > 0 and seen[2] == seen[1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_typed_key_in_the_state_is_state_like_any_other(stage):
    """``optax.noisy_sgd`` keeps ``jax.random.key(...)`` in its state: replicated, and the
    noise drawn from it the same as single-device Optax's."""
    make = lambda: optax.noisy_sgd(0.1, key=jax.random.key(3))
    (params, state), (ref, ref_state) = _side_by_side(make, stage)
    _close(params, ref)
    key = state[0].rng_key
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert key.sharding.spec == P()
    assert jnp.array_equal(jax.random.key_data(key), jax.random.key_data(ref_state[0].rng_key))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_typed_key_in_the_state_of_jzeros_own_step(stage):
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(optax.noisy_sgd(0.1, key=jax.random.key(3)), mesh, stage=stage)
    state = opt.init(_params())
    state, _ = opt.train_step(lambda p, b: _loss(p))(state, {"x": jnp.zeros((8,))})
    ref_tx, ref = optax.noisy_sgd(0.1, key=jax.random.key(3)), _params()
    updates, _ = ref_tx.update(jax.grad(_loss)(ref), ref_tx.init(ref), ref)
    _close(state.params, optax.apply_updates(ref, updates))


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_tree_map_params_gets_optaxs_own_answer(precision):
    """``optax.tree_map_params`` (Optax's documented way to build the state's specs) calls
    ``init`` with a placeholder; the drop-in answers as the wrapped transformation does."""
    mesh = jzero.data_mesh()
    options = {} if precision is None else {"precision": jzero.Precision(param_dtype=precision)}
    tx = jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=2, **options)
    params = _params() if precision is None else jax.tree.map(jnp.bfloat16, _params())
    state = tx.init(params)
    marked = optax.tree_map_params(tx, lambda _: "param", state, transform_non_params=lambda _: 0)
    inner = marked if precision is None else marked.inner_state
    assert inner[0].mu == {"w": "param", "b": "param"} and inner[0].count == 0
    if precision is not None:
        assert marked.master == {"w": "param", "b": "param"}


def _complex_params():
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    w = jax.lax.complex(jax.random.normal(k1, (16, 8)), jax.random.normal(k2, (16, 8)))
    return {"w": w, "r": jax.random.normal(k3, (8, 16))}


def _complex_loss(params, batch):
    y = batch["x"] @ params["w"]
    return jnp.mean(jnp.abs(y - 1.0) ** 2) + jnp.mean((params["r"] @ batch["x"].real.T) ** 2)


def _complex_batch():
    x = jax.random.normal(jax.random.key(2), (32, 16))
    return {"x": jax.lax.complex(x, jnp.flip(x, 0))}


def _complex_reference(tx):
    params, state = _complex_params(), tx.init(_complex_params())
    for _ in range(STEPS):
        grads = jax.grad(_complex_loss)(params, _complex_batch())
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_complex_parameters_in_the_users_step(stage):
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1)
    params = _placed(_complex_params(), mesh, stage)
    state = tx.init(params)
    batch = jax.device_put(_complex_batch(), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(params, state, batch):
        updates, state = tx.update(jax.grad(_complex_loss)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(STEPS):
        params, state = step(params, state, batch)
    assert params["w"].dtype == jnp.complex64
    _close(params, _complex_reference(optax.adam(1e-2)))


@pytest.mark.parametrize(
    "stage, options",
    [(0, {}), (1, {}), (2, {}), (3, {}), (2, {"grad_accum": 2}),
     (3, {"comm": jzero.Communication(bucket=True)})],
)  # fmt: skip
def test_complex_parameters_in_jzeros_own_step(stage, options):
    mesh = jzero.data_mesh()
    options = dict(options)
    grad_accum = options.pop("grad_accum", 1)
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1, **options)
    state = opt.init(_complex_params())
    step = opt.train_step(_complex_loss, grad_accum=grad_accum)
    for _ in range(STEPS):
        state, metrics = step(state, _complex_batch())
    _close(state.params, _complex_reference(optax.adam(1e-2)))


# Optax's own apply_updates casts the complex updates onto the real parameters, and warns
@pytest.mark.filterwarnings("ignore:Casting from complex to real:DeprecationWarning")
def test_complex_state_of_real_parameters():
    """``mu_dtype=jnp.complex64``: only the state is complex."""
    (params, state), (ref, _) = _side_by_side(lambda: optax.adam(1e-2, mu_dtype=jnp.complex64), 2)
    assert state[0].mu["w"].dtype == jnp.complex64
    _close(params, ref)


def test_stage_2_params_placed_once_compile_the_step_once(caplog):
    """Parameters made on one device, placed with ``shard_params(stage=2)`` (replicated on
    the mesh, where the update returns them): the second step reuses the first's program."""
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=2)
    params = jzero.shard_params(_params(), mesh, stage=2)
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(params))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(_loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        step(params, state)
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]


def test_a_root_array_is_named_as_the_tree():
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=1)
    with pytest.raises(TypeError, match=r"^params leaf \['w'\] is a str,"):
        opt.init({"w": "weights"})
    tx = jzero.shard_optimizer(optax.sgd(0.1), jzero.data_mesh(), stage=1)
    with pytest.raises(TypeError, match=r"^grads \(one array\) is a list|^grads \(one array\)"):
        tx.update(object(), tx.init(jnp.ones(8)))


def test_unplaced_stage_3_params_say_where_they_rest():
    tx = jzero.shard_optimizer(optax.sgd(0.1), jzero.data_mesh(), stage=3)
    where = r"params\['w'\] rests on 1 device \(SingleDeviceSharding\)"
    with pytest.raises(ValueError, match=where):
        tx.init({"w": jnp.ones((8, 8))})


def test_a_mesh_of_another_size_is_named():
    mesh = jzero.data_mesh()
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    tx = jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=2)
    params = _params()
    state = tx.init(params)
    wrong = pytest.raises(ValueError, match="built for a mesh of 8 devices.*a mesh of 4")
    with wrong, jax.set_mesh(four):
        jax.jit(lambda p, s: tx.update(p, s, p))(params, state)
