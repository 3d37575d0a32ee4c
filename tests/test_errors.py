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
    with pytest.raises(ValueError, match=r"batch leaf \['x'\].*divisible by the data-axis size 8"):
        opt.train_step(awkward_loss)(state, batch)


def test_mesh_without_data_axis():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"no 'data' axis.*jzero.data_mesh\(\)"):
        jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=1)


def test_explicit_mesh_axes_rejected():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="AxisType.Explicit.*AxisType.Auto"):
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
