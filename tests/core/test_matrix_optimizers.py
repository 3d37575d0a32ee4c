"""Matrix optimizers (Muon, GaLore, Adafactor) on whole matrices: single-device Optax's
numbers at every step and stage, the layout and stacks the plan gives their leaves, and
the features they meet (hpZ, accumulation, bf16 masters, checkpoints, offload). What they
cost is in test_matrix_optimizer_costs.py."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _matrices import MODEL_SPECS, OPTIMIZERS, batches, model, scanned_params, unrolled_params
from _models import OPTIMIZERS as ELEMENTWISE
from _models import assert_each_step_is_optax, awkward_params, record
from jax.sharding import AxisType

import jzero

CASES = [
    *(("muon", s) for s in (0, 1, 2, 3)),
    *(("muon_scanned", s) for s in (0, 1, 2, 3)),
    ("muon_options", 1),
    ("muon_options", 3),
    ("clip_muon", 2),
    ("adafactor", 3),
    ("galore", 1),
    ("galore", 3),
]


def _each_step_is_optax(name: str, mesh, **config) -> tuple:
    """A 3-step run of ``OPTIMIZERS[name]`` on ``mesh``, checked against single-device
    Optax at every step; its final state and trajectory."""
    make, scanned = OPTIMIZERS[name]
    params, loss = model(scanned)
    opt = jzero.ZeroOptimizer(make(), mesh, **config)
    train_step = opt.train_step(loss)

    def step(state, batch):
        state, metrics = train_step(state, batch)
        return state, metrics["loss"]

    whole = lambda state: (opt.full_params(state), opt.full_state(state).opt_state)
    data = batches(3)
    state, trajectory = record(step, opt.init(params), whole, data)
    assert_each_step_is_optax(make(), loss, trajectory, data)
    return state, trajectory


@pytest.mark.every_case  # each (optimizer, stage) is a claim of the issue
@pytest.mark.parametrize(("name", "stage"), CASES)
def test_each_step_is_single_device_optax(name, stage):
    _, trajectory = _each_step_is_optax(name, jzero.data_mesh(), stage=stage)
    if name.startswith("muon"):  # every weight Optax routes to Muon has Muon's momentum
        muon_state = trajectory.wholes[-1][1].inner_states["muon"].inner_state[0]
        for path, mu in jax.tree_util.tree_leaves_with_path(muon_state.mu):
            assert float(np.abs(mu).max()) > 0, jax.tree_util.keystr(path)


def test_plan_says_which_leaves_are_updated_whole():
    mesh = jzero.data_mesh()
    rows = lambda tx, params: {
        r.split()[0]: r
        for r in jzero.ZeroOptimizer(tx, mesh, stage=1).plan(params).describe().splitlines()[1:]
    }
    unrolled = rows(OPTIMIZERS["muon"][0](), unrolled_params())
    assert unrolled["['l0']['up']"].endswith("whole 0,1 in stack 1 (8 leaves)")
    assert unrolled["['l0']['b']"].endswith(" -")
    scanned = rows(OPTIMIZERS["muon_scanned"][0](), scanned_params())
    assert scanned["['up']"].endswith("whole 1,2 by dim 0")  # the layer axis, not a matrix axis
    adam = rows(optax.adamw(1e-2), unrolled_params())
    assert all(r.endswith(" -") for r in adam.values())


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_keep_their_layout(name):
    """No axis mixed, so no owner layout and no stack: the program is the one before."""
    plan = jzero.ZeroOptimizer(ELEMENTWISE[name](), jzero.data_mesh(), stage=3).plan(
        awkward_params()
    )
    assert plan.matrices is not None and not any(plan.matrices.mixed), name
    assert not any(plan.matrices.layouts) and not any(s is not None for s in plan.matrices.stacks)


def test_scanned_muon_state_rests_along_the_layer_axis():
    opt = jzero.ZeroOptimizer(OPTIMIZERS["muon_scanned"][0](), jzero.data_mesh(), stage=3)
    state = opt.init(scanned_params())
    mu = state.opt_state.inner_states["muon"].inner_state[0].mu
    assert mu["up"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert mu["up"].addressable_data(0).shape == (1, 16, 32)  # one whole matrix per device
    assert state.params["up"].sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_offload_says_the_matrices_are_updated_split():
    opt = jzero.ZeroOptimizer(
        OPTIMIZERS["muon"][0](), jzero.data_mesh(), stage=2, offload=jzero.Offload(optimizer="host")
    )
    with pytest.warns(UserWarning, match="16 leaves whose update mixes"):
        plan = opt.plan(unrolled_params())
    assert not any(s is not None for s in plan.matrices.stacks)
    assert "mixes 0,1" in plan.describe()


def _run(name: str, steps: int = 2, grad_accum: int = 1, **config):
    make, scanned = OPTIMIZERS[name]
    params, loss = model(scanned)
    opt = jzero.ZeroOptimizer(make(), jzero.data_mesh(), **config)
    state, step = opt.init(params), opt.train_step(loss, grad_accum=grad_accum)
    for batch in batches(steps):
        state, _ = step(state, batch)
    return opt, state


@pytest.mark.parametrize("name", ["muon", "muon_scanned"])
def test_hpz_and_gradient_accumulation_keep_optax_numbers(name):
    """hpZ gathers and micro-batches change how the gradient is formed, not the update on
    whole matrices: the same parameters as plain data parallelism (stage 0, no stacks)."""
    opt0, s0 = _run(name, stage=0)
    for config in ({"stage": 3, "comm": jzero.Communication(hpz=2)}, {"stage": 2}):
        opt, state = _run(name, grad_accum=2 if config["stage"] == 2 else 1, **config)
        got, want = opt.full_params(state), opt0.full_params(s0)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ["muon", "muon_scanned"])
def test_bf16_with_fp32_master_weights(name):
    """The fp32 master weights (in the owner layout, or stacked for the update) match
    stage 0's to fp32 rounding; the bf16 parameters to one bf16 rounding of them."""
    bf16 = jzero.Precision(param_dtype=jax.numpy.bfloat16, dynamic_loss_scale=True)
    opt0, s0 = _run(name, stage=0, precision=bf16)
    opt, state = _run(name, stage=3, precision=bf16)
    want, got = opt0.full_state(s0), opt.full_state(state)
    for g, w in zip(jax.tree.leaves(got.master), jax.tree.leaves(want.master)):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("name", ["muon", "muon_scanned"])
def test_checkpoint_at_stage_1_on_8_restores_at_stage_3_on_4(tmp_path, name):
    from jzero.checkpoint import Checkpointer

    opt, state = _run(name, stage=1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
    make, scanned = OPTIMIZERS[name]
    on_4 = jzero.ZeroOptimizer(make(), jzero.data_mesh(jax.devices()[:4]), stage=3)
    restored = Checkpointer(tmp_path).restore(on_4, model(scanned)[0]).state
    want, got = opt.full_state(state), on_4.full_state(restored)
    for g, w in zip(
        jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves((want.params, want.opt_state))
    ):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("name", ["muon", "muon_scanned"])
def test_a_model_axis_beside_data_keeps_optax_numbers(name):
    """4 data x 2 model, each matrix split over 'model': the update still sees whole
    matrices (single-device Optax at every step, stage 3). Along an owner axis the leaf
    stays split over 'model', and so does a stack's (along 'data'): the compiler
    partitions Newton-Schulz over 'model' (test_matrix_optimizer_costs.py: the FLOPs)."""
    scanned = OPTIMIZERS[name][1]
    params = model(scanned)[0]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = MODEL_SPECS[scanned](params)
    state, _ = _each_step_is_optax(name, mesh, stage=3, param_specs=specs)
    leaf = state.params["up"] if scanned else state.params["l0"]["up"]
    assert "model" in leaf.sharding.spec  # the parameters stay split over 'model'
    opt = jzero.ZeroOptimizer(OPTIMIZERS[name][0](), mesh, stage=3, param_specs=specs)
    assert ("by dim 0" if scanned else "in stack") in opt.plan(params).describe()
