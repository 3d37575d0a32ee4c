"""Shardings and per-shard shapes of params, optimizer state and gradients, per stage."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params, stacked_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import collectives
from jzero.core.leaf_layout import leaf_layout

N = 8


@pytest.mark.parametrize(
    "shape, dim, padded",
    [
        ((13, 40), 1, (13, 40)),  # the divisible dim, no padding
        ((40, 13), 1, (40, 16)),  # the leading dim is never sharded (may be stacked layers)
        ((3, 13, 7), 1, (3, 16, 7)),  # none divides: the largest non-leading, padded
        ((7,), 0, (8,)),  # shorter than the device count: padded
        ((4, 64, 64), 1, (4, 64, 64)),  # the first divisible non-leading dim
        ((8, 16, 24), 1, (8, 16, 24)),  # contiguous shards, not the largest dim
        ((8, 100), 1, (8, 104)),  # stacked (layers, d): pad d rather than split the layers
    ],
)
def test_leaf_layout_rule(shape, dim, padded):
    lay = leaf_layout(shape, N, min_shard_size=1)
    assert (lay.dim, lay.padded) == (dim, padded)
    assert lay.spec[dim] == "data"


def test_small_leaves_and_scalars_stay_replicated():
    assert leaf_layout((), N, min_shard_size=0).dim is None
    assert leaf_layout((1000,), N, min_shard_size=1024).dim is None
    assert leaf_layout((1024,), N, min_shard_size=1024).dim == 0


def _expected(stage, lay, what):
    sharded = lay.sharded and (what == "opt" and stage >= 1 or what == "params" and stage == 3)
    if not sharded:
        return P(*lay.user_spec), lay.shape if what == "params" else lay.padded
    local = list(lay.padded)
    local[lay.dim] //= N
    return lay.spec, tuple(local)


def _check_tree(tree, lays, stage, what, mesh):
    for x, lay in zip(jax.tree.leaves(tree), lays):
        spec, local = _expected(stage, lay, what)
        assert x.sharding == NamedSharding(mesh, spec), (what, lay)
        assert x.addressable_data(0).shape == local, (what, lay)
        assert len(x.addressable_shards) == N


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shardings_after_init_and_after_a_step(stage):
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1)
    state = opt.init(awkward_params())
    for _ in range(2):  # after init, then after a step
        _check_tree(state.params, state.plan.layouts, stage, "params", mesh)
        _check_tree(state.opt_state, state.plan.opt_layouts, stage, "opt", mesh)
        assert state.step.sharding == NamedSharding(mesh, P())
        state, _ = opt.train_step(awkward_loss)(state, awkward_batches(1)[0])
    assert int(state.step) == 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_step_shardings_and_gradient_shards(stage):
    """Under jit: the compiled step's in/out shardings are the plan's, and the gradients
    are reduced to per-device shards (stages >= 1) of the plan's per-shard shape."""
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=stage, min_shard_size=1)
    state = opt.init(awkward_params())
    compiled = opt.train_step(awkward_loss).lower(state, awkward_batches(1)[0]).compile()
    want = jax.tree.leaves(state.plan.state_shardings(opt.precision))
    (state_in, _), _ = compiled.input_shardings
    assert [s.spec for s in jax.tree.leaves(state_in)] == [s.spec for s in want]
    state_out, _ = compiled.output_shardings
    assert [s.spec for s in jax.tree.leaves(state_out)] == [s.spec for s in want]

    scattered = sorted(
        c.shape for c in collectives(compiled.as_text()) if c.kind == "reduce-scatter"
    )
    shard_shapes = []
    for lay in state.plan.layouts:
        if lay.sharded:
            local = list(lay.padded)
            local[lay.dim] //= N
            shard_shapes.append(tuple(local))
    assert scattered == ([] if stage == 0 else sorted(shard_shapes))


def test_user_model_axis_spec_is_kept_and_data_added():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {"w": jnp.ones((16, 8)), "v": jnp.ones((12, 6))}
    specs = {"w": P(None, "model"), "v": P("model", None)}
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=3, min_shard_size=1, param_specs=specs)
    state = opt.init(params)
    assert state.params["w"].sharding.spec == P("data", "model")
    assert state.params["v"].sharding.spec == P("model", "data")
    assert state.params["w"].addressable_data(0).shape == (4, 4)
    assert state.params["v"].addressable_data(0).shape == (6, 2)  # 12/2 model; 6 -> 8 padded /4
    mu = state.opt_state[0].mu
    assert mu["w"].sharding.spec == P("data", "model")

    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"]) ** 2) + jnp.mean(p["v"] ** 2)

    state, metrics = opt.train_step(loss_fn)(state, {"x": jnp.ones((8, 16))})
    assert state.params["w"].sharding.spec == P("data", "model")
    ref = jax.grad(loss_fn)(params, {"x": jnp.ones((8, 16))})
    assert jnp.allclose(metrics["grad_norm"], optax.tree.norm(ref), rtol=1e-6)


def test_init_from_abstract_shapes_never_holds_the_whole_model():
    mesh = jzero.data_mesh()
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=3)
    init_fn = functools.partial(stacked_params, 8, 256)
    abstract = jax.eval_shape(init_fn)
    fn, arg = opt.init_program(abstract, init_fn=init_fn)
    mem = fn.lower(arg).compile().memory_analysis()
    full_param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    # Output: params + two Adam moments, each 1/N per device; temporaries below one copy.
    assert mem.output_size_in_bytes <= 3 * full_param_bytes / N + 1024
    assert mem.temp_size_in_bytes < full_param_bytes / 2
    state = fn(arg)
    full = opt.full_params(state)
    ref = init_fn()
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):  # same values as eager init
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_plan_describe_reports_every_leaf():
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)
    text = opt.plan(awkward_params()).describe()
    rows = text.splitlines()
    assert rows[0].split() == ["leaf", "shape", "shard", "dim", "stored", "pad", "spec", "update"]
    assert len(rows) == 1 + len(awkward_params())
    w1 = next(r for r in rows if r.startswith("['w1']"))
    assert "(13, 7)" in w1 and "(13, 8)" in w1 and "P(None, 'data')" in w1  # padded 7 -> 8
