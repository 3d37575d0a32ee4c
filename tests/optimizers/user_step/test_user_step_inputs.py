"""What a user passes to ``jzero.shard_optimizer`` / ``jzero.nnx.Optimizer`` that the happy
path does not: bad meshes, stages and trees (clear errors), an update called outside ``jit``
(it works, with the jitted numbers), Explicit meshes, 16-bit parameters with fp32 master
weights, options that need jzero's own step, and an NNX optimizer's state through Orbax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import assert_tree_close, awkward_batches, awkward_loss, awkward_params
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jzero


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (16, 32)), "v": jax.random.normal(k2, (32, 8))}


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"]) ** 2)


def _batch(seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (32, 16)), "y": jax.random.normal(ky, (32, 8))}


def test_a_mesh_without_data_is_refused():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="no 'data' axis"):
        jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=2)


@pytest.mark.parametrize("stage", [4, -1, "2", True])
def test_a_stage_outside_0_to_3_is_refused(stage):
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        jzero.shard_optimizer(optax.adam(1e-3), jzero.data_mesh(), stage=stage)


def test_gradients_of_another_tree_are_refused():
    tx = jzero.shard_optimizer(optax.adam(1e-3), jzero.data_mesh(), stage=2)
    params = _params()
    state = tx.init(params)
    grads = jax.grad(_loss)(params, _batch())
    with pytest.raises(ValueError, match="gradients' tree .* differs from the parameters'"):
        tx.update({"w": grads["w"]}, state, params)
    with pytest.raises(ValueError, match="does not match the tree this optimizer state"):
        tx.update({"w": grads["w"]}, state)
    with pytest.raises(ValueError, match=r"gradient \['v'\] has shape \(8, 32\)"):
        tx.update({"w": grads["w"], "v": grads["v"].T}, state, params)


def test_stage_3_refuses_parameters_not_placed_with_shard_params():
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.adam(1e-3), mesh, stage=3)
    with pytest.raises(ValueError, match=r"jzero.shard_params\(params, mesh\)"):
        tx.init(_params())
    tx.init(jzero.shard_params(_params(), mesh))  # placed: fine


@pytest.mark.parametrize(
    "option, match",
    [
        ({"comm": jzero.Communication(bucket=True)}, "comm="),
        ({"offload": jzero.Offload(optimizer="host")}, "offload="),
        ({"precision": jzero.Precision(param_dtype="fp16")}, "dynamic_loss_scale"),
        ({"precision": jzero.Precision(reduce_dtype="bf16")}, "reduce_dtype"),
    ],
)
def test_options_of_jzeros_own_step_are_refused_with_the_way_out(option, match):
    with pytest.raises(ValueError, match=match) as info:
        jzero.shard_optimizer(optax.adam(1e-3), jzero.data_mesh(), stage=3, **option)
    assert "train_step(loss_fn)" in str(info.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_update_outside_jit_on_unsharded_inputs_equals_the_jitted_update(stage):
    mesh = jzero.data_mesh()
    tx = jzero.shard_optimizer(optax.adamw(1e-2, weight_decay=0.1), mesh, stage=stage)
    params = jzero.shard_params(_params(), mesh) if stage == 3 else _params()
    state = tx.init(params)
    grads = jax.device_put(jax.grad(_loss)(_params(), _batch()), jax.devices()[0])
    eager = tx.update(grads, state, params)  # gradients on one device, the state on eight
    on_mesh = jax.device_put(grads, NamedSharding(mesh, P()))
    jitted = jax.jit(tx.update)(on_mesh, state, params)
    assert_tree_close(eager, jitted, rtol=0, atol=0)
    updates, new_state = eager
    assert new_state[0].mu["w"].sharding.spec == P(None, "data")
    assert updates["w"].sharding.spec == (P(None, "data") if stage == 3 else P())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_explicit_mesh_gives_the_auto_meshs_numbers(stage):
    """``jax.make_mesh``'s default axes are Explicit; under ``jax.set_mesh`` the user's
    step traces with sharding in types. At stage 3 the user's model gathers its sharded
    weights where it uses them (``jax.sharding.reshard``), as JAX's explicit-sharding FSDP
    does."""

    def run(mesh, loss):
        tx = jzero.shard_optimizer(optax.adamw(1e-2, weight_decay=0.1), mesh, stage=stage)
        params = jzero.shard_params(_params(), mesh) if stage == 3 else _params()
        state = tx.init(params)

        @jax.jit
        def step(params, state, batch):
            grads = jax.grad(loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for seed in range(3):
            params, state = step(
                params, state, jax.device_put(_batch(seed), NamedSharding(mesh, P("data")))
            )
        return params, state

    auto = run(jzero.data_mesh(), _loss)
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    gathered = lambda p, b: _loss(jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p), b)
    with jax.set_mesh(explicit):
        params, state = run(explicit, gathered)
    assert_tree_close((params, state), auto, rtol=1e-6, atol=1e-6)
    assert jax.typeof(params["w"]).sharding.mesh.axis_types == (AxisType.Explicit,)
    assert state[0].mu["w"].sharding.spec == P(None, "data")


def test_bf16_parameters_keep_fp32_master_weights_that_step_as_optax_does():
    """With ``Precision(param_dtype=bf16)`` the state holds fp32 master weights; an update
    steps them as single-device Optax steps an fp32 copy on the same gradients (rtol 1e-6),
    and the returned (fp32) updates take the bf16 parameters to the master's rounding
    bitwise, through ``optax.apply_updates``."""
    mesh, f32 = jzero.data_mesh(), jnp.float32
    precision = jzero.Precision(param_dtype=jnp.bfloat16)
    tx = jzero.shard_optimizer(optax.adam(1e-2), mesh, stage=2, precision=precision)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    state = tx.init(params)
    assert isinstance(state, jzero.MasterWeightsState)
    assert state.master["w"].dtype == f32 and state.master["w"].sharding.spec == P(None, "data")
    ref_master, ref_state = (
        jax.tree.map(lambda x: x.astype(f32), params),
        optax.adam(1e-2).init(jax.tree.map(lambda x: x.astype(f32), params)),
    )
    step = jax.jit(tx.update)
    for seed in range(3):
        grads = jax.grad(_loss)(params, _batch(seed))  # bf16, as the user's backward gives
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = optax.adam(1e-2).update(
            jax.tree.map(lambda g: g.astype(f32), grads), ref_state, ref_master
        )
        ref_master = optax.apply_updates(ref_master, ref_updates)
        assert_tree_close(state.master, ref_master, rtol=1e-6, atol=1e-7)
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(state.master)):
            assert p.dtype == jnp.bfloat16
            np.testing.assert_array_equal(p, m.astype(jnp.bfloat16))


def test_master_weights_need_the_parameters_in_update():
    precision = jzero.Precision(param_dtype=jnp.bfloat16)
    tx = jzero.shard_optimizer(optax.adam(1e-2), jzero.data_mesh(), stage=1, precision=precision)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"tx.update\(grads, opt_state, params\)"):
        tx.update(jax.grad(_loss)(params, _batch()), state)


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(40, 16, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def test_an_nnx_optimizers_state_round_trips_through_orbax(tmp_path):
    mesh, batches = jzero.data_mesh(), awkward_batches(2)
    model = _Mlp(nnx.Rngs(0))
    opt = jzero.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, mesh=mesh, stage=3)

    @nnx.jit
    def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)

    step(model, opt, jax.device_put(batches[0], NamedSharding(mesh, P("data"))))
    saved = nnx.state(opt)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "opt", saved)
    fresh = jzero.nnx.Optimizer(
        _Mlp(nnx.Rngs(1)), optax.adam(1e-2), wrt=nnx.Param, mesh=mesh, stage=3
    )
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), nnx.state(fresh)
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "opt", target)
    nnx.update(fresh, restored)
    for a, b in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(saved)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


def test_shard_params_in_an_nnx_model_is_what_the_optimizer_does_at_stage_3():
    mesh = jzero.data_mesh()
    model = _Mlp(nnx.Rngs(0))
    jzero.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, mesh=mesh, stage=3)
    placed = jzero.shard_params(nnx.state(_Mlp(nnx.Rngs(0)), nnx.Param), mesh)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(placed)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


def test_the_awkward_model_trains_in_a_user_step_at_every_stage_alike():
    """Stages 0-3 of the same user step give the same numbers as one another (rtol 1e-6): the
    stage changes where the state rests, not the training."""
    mesh, batches = jzero.data_mesh(), awkward_batches(3)
    results = []
    for stage in (0, 1, 2, 3):
        tx = jzero.shard_optimizer(optax.adam(1e-2), mesh, stage=stage)
        params = awkward_params()
        params = jzero.shard_params(params, mesh) if stage == 3 else params
        state = tx.init(params)
        for batch in batches:
            grads = jax.grad(awkward_loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        results.append(params)
    for other in results[1:]:
        assert_tree_close(other, results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_axis_beside_data_keeps_the_users_specs(stage):
    """``param_specs`` over a ``model`` axis (and, the same way, logical ``rules``) as
    ``ZeroOptimizer`` reads them: the state adds ``data`` beside ``model``, the parameters
    keep their ``model`` split, and the numbers are the data-only mesh's."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layout = jzero.Layout(param_specs={"w": P(None, "model"), "v": P("model", None)})
    tx = jzero.shard_optimizer(optax.adam(1e-2), mesh, stage=stage, param_specs=layout.param_specs)
    specs = {"w": P(None, "model"), "v": P("model", None)}
    params = jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()})
    if stage == 3:
        params = jzero.shard_params(params, mesh, layout=layout)
    state = tx.init(params)
    assert state[0].mu["w"].sharding.spec == P("data", "model")
    assert state[0].mu["v"].sharding.spec == P("model", "data")

    @jax.jit
    def step(params, state, batch):
        updates, state = tx.update(jax.grad(_loss)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    params, state = step(params, state, batch)
    want = {"w": P("data", "model"), "v": P("model", "data")} if stage == 3 else specs
    assert {k: v.sharding.spec for k, v in params.items()} == want
    ref = optax.adam(1e-2)
    ref_params = _params()
    updates, _ = ref.update(jax.grad(_loss)(ref_params, _batch()), ref.init(ref_params), ref_params)
    assert_tree_close(params, optax.apply_updates(ref_params, updates), rtol=1e-6, atol=1e-6)
