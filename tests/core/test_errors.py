"""Bad input raises an error that names the problem and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params

import jzero


def _opt(stage=1, **kw):
    return jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=stage, **kw)


def test_batch_not_divisible_by_data_axis():
    opt = _opt()
    state = opt.init(awkward_params())
    batch = {"x": jnp.ones((12, 40)), "y": jnp.ones((12, 5))}
    with pytest.raises(ValueError, match=r"batch leaf \[.x.\].*divisible by the 8 data-parallel"):
        opt.train_step(awkward_loss)(state, batch)


def test_mesh_without_data_axis():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"no 'data' axis.*jzero.data_mesh\(\)"):
        jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=1)


def test_manual_mesh_axes_rejected():
    # Auto and Explicit axes are accepted (tests/core/test_explicit_mesh.py).
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()), ("data",), axis_types=(jax.sharding.AxisType.Manual,)
    )
    with pytest.raises(ValueError, match=r"\['data'\] are AxisType.Manual.*Auto or Explicit"):
        jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=1)


@pytest.mark.parametrize("stage", [-1, 4, "3", 1.0, True])
def test_stage_outside_0_to_3(stage):
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        _opt(stage=stage)


def test_not_an_optax_transformation():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jzero.ZeroOptimizer(lambda g: g, jzero.data_mesh(), stage=1)


@pytest.mark.parametrize("leaf", ["a string", 3.0, object()])
def test_non_array_leaves(leaf):
    params = dict(awkward_params(), bad=leaf)
    with pytest.raises(TypeError, match=r"params leaf \['bad'\].*not an array.*jnp.asarray"):
        _opt().init(params)


def test_params_tree_that_does_not_match_init():
    opt = _opt()
    state = opt.init(awkward_params())
    other = state.replace(params={"w": state.params["w1"]})
    with pytest.raises(ValueError, match="does not match the parameter tree given to init"):
        opt.train_step(awkward_loss)(other, awkward_batches(1)[0])
    with pytest.raises(ValueError, match="does not match the parameter tree given to init"):
        opt.full_params(other)


def test_abstract_shapes_that_do_not_match_init_fn():
    shapes = jax.eval_shape(awkward_params)
    shapes["w1"] = jax.ShapeDtypeStruct((13, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"params leaf \['w1'\] is float32\[13, 8\].*init_fn"):
        _opt().init(shapes, init_fn=awkward_params)


def test_abstract_shapes_without_init_fn():
    with pytest.raises(ValueError, match="no init_fn"):
        _opt().init(jax.eval_shape(awkward_params))


def test_state_from_another_stage():
    state = _opt(stage=1).init(awkward_params())
    with pytest.raises(ValueError, match="made for stage 1.*this optimizer is stage 3"):
        _opt(stage=3).train_step(awkward_loss)(state, awkward_batches(1)[0])


def test_user_spec_naming_data_axis():
    with pytest.raises(ValueError, match="names the 'data' axis"):
        _opt(param_specs=jax.sharding.PartitionSpec("data")).init({"w": np.ones((16, 16))})


def test_spec_naming_an_axis_the_mesh_lacks():
    specs = {"w": jax.sharding.PartitionSpec(None, "model")}
    with pytest.raises(ValueError, match=r"param \['w'\] is partitioned over mesh axis 'model'"):
        _opt(param_specs=specs).init({"w": np.ones((16, 16), np.float32)})


def test_model_axis_that_does_not_divide_the_dim():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    opt = jzero.ZeroOptimizer(
        optax.adam(1e-2),
        mesh,
        stage=3,
        param_specs={"w": jax.sharding.PartitionSpec(None, "model")},
    )
    with pytest.raises(ValueError, match=r"dim 1 \(6\) is partitioned over mesh axes"):
        opt.init({"w": np.ones((16, 6), np.float32)})


def test_state_from_another_precision_policy():
    state = _opt(stage=1).init(awkward_params())
    bf16 = jzero.Precision(param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="different precision policy"):
        _opt(stage=1, precision=bf16).train_step(awkward_loss)(state, awkward_batches(1)[0])


# --------------------------------------------------------------- rough edges (P5 part 2)
def test_reusing_a_donated_state_is_refused_not_a_segfault():
    opt = _opt(stage=3)
    state = opt.init(awkward_params())
    step, batch = opt.train_step(awkward_loss), awkward_batches(1)[0]
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match=r"donated to \(consumed by\) an earlier train_step.*"):
        step(state, batch)
    with pytest.raises(ValueError, match="donate=False"):
        step(state, batch)
    new, _ = step(new, batch)  # the returned state goes on
    assert int(new.step) == 2


def test_donate_false_keeps_the_old_state_usable():
    opt = _opt(stage=2)
    state = opt.init(awkward_params())
    step, batch = opt.train_step(awkward_loss, donate=False), awkward_batches(1)[0]
    a, _ = step(state, batch)
    b, _ = step(state, batch)  # the same state again
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_batch_leaves_with_different_leading_dimensions():
    opt = _opt()
    state = opt.init(awkward_params())
    batch = awkward_batches(1)[0]
    batch = {"x": batch["x"], "y": batch["y"][:8]}
    with pytest.raises(ValueError, match=r"different leading \(batch\) dimensions.*\['x'\]: 16"):
        opt.train_step(awkward_loss)(state, batch)


@pytest.mark.parametrize("params", [{}, {"a": {}, "b": []}, None])
def test_empty_params(params):
    if params is None:  # init_fn returning nothing
        with pytest.raises(ValueError, match="params is empty.*nothing to train"):
            _opt().init(init_fn=dict)
        return
    with pytest.raises(ValueError, match="params is empty.*nothing to train"):
        _opt().init(params)


def test_integer_loss_is_refused():
    opt = _opt()
    state = opt.init(awkward_params())
    int_loss = lambda p, b: jnp.sum(b["x"] > 0).astype(jnp.int32)
    with pytest.raises(TypeError, match="floating-point scalar.*int32.*integer loss has zero"):
        opt.train_step(int_loss)(state, awkward_batches(1)[0])


def test_non_scalar_loss_is_refused():
    opt = _opt()
    state = opt.init(awkward_params())
    per_row = lambda p, b: jnp.mean(b["x"] @ p["emb"], axis=1)
    with pytest.raises(TypeError, match=r"floating-point scalar.*shape \(2,\).*jnp.mean"):
        opt.train_step(per_row)(state, awkward_batches(1)[0])


def test_loss_with_aux_without_has_aux():
    opt = _opt()
    state = opt.init(awkward_params())
    with_aux = lambda p, b: (awkward_loss(p, b), {"acc": jnp.float32(1)})
    with pytest.raises(TypeError, match=r"returned a tuple of 2.*has_aux=True"):
        opt.train_step(with_aux)(state, awkward_batches(1)[0])


def test_model_state_loss_returning_a_bare_scalar():
    opt = _opt()
    state = opt.init(awkward_params(), model_state={"count": jnp.zeros((), jnp.int32)})
    bare = lambda p, ms, b: awkward_loss(p, b)
    with pytest.raises(TypeError, match=r"must return a pair \(loss, new_model_state\).*unchanged"):
        opt.train_step(bare, with_model_state=True)(state, awkward_batches(1)[0])


def test_state_from_another_optax_transformation():
    state = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=1).init(awkward_params())
    with pytest.raises(ValueError, match="different Optax transformation.*this optimizer's init"):
        _opt(stage=1).train_step(awkward_loss)(state, awkward_batches(1)[0])


@pytest.mark.parametrize(
    "option, config",
    [
        ("grad_quant", {"comm": jzero.Communication(grad_quant="int8")}),
        ("gather_quant", {"stage": 3, "comm": jzero.Communication(gather_quant="int8")}),
        ("hpz", {"stage": 3, "comm": jzero.Communication(hpz=2)}),
    ],
)
def test_complex_parameters_where_a_path_is_real_only(option, config):
    """Complex leaves train at every stage (tests/optimizers/user_step/test_drop_in_inputs.py);
    the quantized collectives and hpZ's gather take real numbers only, and say so."""
    params = {"w": np.ones((8, 2), np.complex64)}
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), **{"stage": 2, **config})
    message = rf"params leaf \['w'\] is complex64, and Communication\({option}=\.\.\.\) works"
    with pytest.raises(NotImplementedError, match=message + " on real numbers only"):
        opt.init(params)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_grad_accum_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="grad_accum must be a positive int"):
        _opt().train_step(awkward_loss, grad_accum=bad)


def test_complex_optimizer_state_with_offload():
    """Only the state is complex (``mu_dtype``): offload's host step names the state leaf."""
    tx = optax.adam(0.1, mu_dtype=jnp.complex64)
    offload = jzero.Offload(optimizer="host")
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=2, offload=offload)
    message = r"optimizer state leaf \[0\]\.mu\['w'\] is complex64, and Offload\(\.\.\.\)"
    with pytest.raises(NotImplementedError, match=message):
        opt.init({"w": np.ones((8, 2), np.float32)})
