"""Meshes as JAX builds them: ``jax.make_mesh`` gives ``AxisType.Explicit`` axes, often used
under ``jax.set_mesh``. jzero computes on the mesh's ``Auto`` twin (``jzero.core.axis_types``)
and hands back arrays typed with the user's mesh: the numbers are single-device Optax's and
bit for bit those of the same run on an ``Auto`` mesh, and the compiled step holds the same
collectives and memory."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import OPTIMIZERS as PARITY_OPTIMIZERS
from _models import assert_each_step_is_optax, awkward_batches, awkward_loss, awkward_params, record
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import collectives

STEPS = 5
E, A = AxisType.Explicit, AxisType.Auto
OPTIMIZERS = {**PARITY_OPTIMIZERS, "muon": lambda: optax.contrib.muon(1e-2)}
MODEL_SPECS = {k: P("model") if k == "emb" else P() for k in awkward_params()}


def _explicit(shape=(8,), names=("data",), types=None):
    mesh = jax.make_mesh(shape, names, axis_types=types)
    assert types is not None or set(mesh.axis_types) == {E}  # jax.make_mesh's default
    return mesh


def _auto(mesh):
    return jax.make_mesh(mesh.axis_sizes, mesh.axis_names, axis_types=(A,) * len(mesh.shape))


class Run:
    """One training run: losses, the final state and what the optimizer exports of it, and
    its trajectory (each state gathered whole, ``_models.record``)."""

    def __init__(self, mesh, stage, tx, *, batches=None, params=None, place=None, **kw):
        self.opt = jzero.ZeroOptimizer(tx, mesh, stage=stage, min_shard_size=1, **kw)
        train_step = self.opt.train_step(awkward_loss)

        def step(state, batch):
            state, self.metrics = train_step(state, place(batch) if place else batch)
            return state, self.metrics["loss"]

        whole = lambda state: (self.opt.full_params(state), self.opt.full_state(state).opt_state)
        self.batches = awkward_batches(STEPS) if batches is None else batches
        state = self.opt.init(awkward_params() if params is None else params)
        self.state, self.trajectory = record(step, state, whole, self.batches)
        self.losses = self.trajectory.losses
        self.params, self.opt_state = whole(self.state)


def _assert_optax(run, name):
    """Each step is single-device Optax's from the same state (``_models.STEP_RTOL``,
    ``STEP_ATOL``)."""
    assert_each_step_is_optax(OPTIMIZERS[name](), awkward_loss, run.trajectory, run.batches)


def _assert_same(run, other):
    """Bit for bit: the same compiled arithmetic."""
    np.testing.assert_array_equal(run.losses, other.losses)
    for tree in ("params", "opt_state"):
        for g, w in zip(jax.tree.leaves(getattr(run, tree)), jax.tree.leaves(getattr(other, tree))):
            np.testing.assert_array_equal(g, w)


def _assert_typed(run, mesh):
    """Every array handed back is typed with ``mesh`` (the user's axis types included), and
    each stored leaf is placed as its plan says."""
    plan, state = run.state.plan, run.state
    stored = [
        (state.params, plan.params),
        (state.opt_state, plan.opt),
        (state.master, plan.master or ()),
    ]
    for tree, infos in stored:
        leaves = jax.tree.leaves(tree)
        assert len(leaves) == len(infos)
        for x, info in zip(leaves, infos):
            assert x.sharding.mesh == mesh and x.sharding.mesh.axis_types == mesh.axis_types
            assert x.sharding.is_equivalent_to(plan.sharding(info), x.ndim), (x.sharding, info)
            assert x.shape == info.shape
    for x in jax.tree.leaves([state.step, run.metrics]):
        assert x.sharding.mesh == mesh
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P()), x.ndim)
    for x in jax.tree.leaves([run.params, run.opt_state]):  # whole: over the user's axes only
        assert x.sharding.mesh == mesh
        assert "data" not in jax.tree.leaves(tuple(x.sharding.spec))


def _collectives(run, batch):
    """The compiled step's collectives (kind, dtype, shape, groups, runs) and temp bytes."""
    step = run.opt.train_step(awkward_loss)
    compiled = step.lower(run.state, batch).compile()
    colls = sorted(
        (c.kind, c.dtype, c.shape, c.groups, c.trip_count) for c in collectives(compiled.as_text())
    )
    return colls, compiled.memory_analysis().temp_size_in_bytes


# ------------------------------------------------------------------- one 'data' axis
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_make_mesh_matches_single_device_optax(stage, name):
    mesh = _explicit()
    run = Run(mesh, stage, OPTIMIZERS[name]())
    _assert_optax(run, name)
    _assert_typed(run, mesh)


# Each transformation at two stages, the four stages between them (CI's time; every stage
# meets Muon on an Explicit mesh in test_make_mesh_matches_single_device_optax).
@pytest.mark.parametrize(
    ("stage", "name"), [(1, "muon"), (3, "muon"), (0, "clip_adam"), (2, "clip_adam")]
)
def test_make_mesh_equals_the_auto_mesh_run_and_its_hlo(stage, name):
    # Muon's Newton-Schulz matmuls contract over a sharded dimension (ShardingTypeError on
    # Explicit axes); clip_by_global_norm adds the update's one scalar all-reduce.
    mesh = _explicit()
    run, auto = Run(mesh, stage, OPTIMIZERS[name]()), Run(_auto(mesh), stage, OPTIMIZERS[name]())
    _assert_same(run, auto)
    assert auto.state.params["emb"].sharding.mesh.axis_types == (A,)
    batch = awkward_batches(1)[0]
    colls, temp = _collectives(run, batch)
    assert (colls, temp) == _collectives(auto, batch)
    assert any(kind != "all-reduce" for kind, *_ in colls) == (stage > 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_under_set_mesh_with_batches_placed_on_it(stage):
    mesh = _explicit()
    plain = Run(mesh, stage, OPTIMIZERS["muon"]())
    with jax.set_mesh(mesh):
        params = jax.device_put(awkward_params(), P())  # typed on the mesh by the user
        params["emb"] = jax.device_put(params["emb"], P("data"))
        assert params["emb"].sharding == NamedSharding(mesh, P("data"))
        run = Run(
            mesh,
            stage,
            OPTIMIZERS["muon"](),
            params=params,
            place=lambda b: jax.device_put(b, P("data")),
        )
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh  # left as it was
    _assert_same(run, plain)
    _assert_typed(run, mesh)


def test_auto_mesh_under_a_set_explicit_mesh():
    # jzero's programs run on jzero's mesh, whatever mesh the caller has set.
    mesh = _explicit()
    plain = Run(_auto(mesh), 3, OPTIMIZERS["muon"]())
    with jax.set_mesh(mesh):
        run = Run(_auto(mesh), 3, OPTIMIZERS["muon"]())
    _assert_same(run, plain)
    _assert_typed(run, _auto(mesh))


# ------------------------------------------------------------------ more axes
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_mesh(stage):
    mesh = _explicit((2, 4), ("replica", "data"))
    for name in ("adam", "muon"):
        run = Run(mesh, stage, OPTIMIZERS[name]())
        _assert_optax(run, name)
        _assert_typed(run, mesh)
        assert run.state.plan.batch_axes == ("replica", "data")
    _assert_same(run, Run(_auto(mesh), stage, OPTIMIZERS["muon"]()))


# Every pair of axis types at stage 3 (where the parameters rest sharded over both axes),
# and each at one lower stage too.
@pytest.mark.parametrize(
    ("stage", "types"),
    [(0, (E, E)), (1, (A, E)), (2, (E, A)), (3, (E, E)), (3, (E, A)), (3, (A, E))],
    ids=["0-EE", "1-AE", "2-EA", "3-EE", "3-EA", "3-AE"],
)
def test_data_and_model_mesh_with_param_specs(stage, types):
    mesh = _explicit((4, 2), ("data", "model"), types)
    run = Run(mesh, stage, OPTIMIZERS["muon"](), param_specs=MODEL_SPECS)
    _assert_optax(run, "muon")
    _assert_typed(run, mesh)
    emb = run.state.params["emb"]  # (40, 13): rows over 'model', columns over 'data' (stage 3)
    assert emb.sharding.is_equivalent_to(
        NamedSharding(mesh, P("model", "data") if stage == 3 else P("model")), 2
    )
    assert emb.addressable_shards[0].data.shape == ((20, 4) if stage == 3 else (20, 13))
    auto = Run(_auto(mesh), stage, OPTIMIZERS["muon"](), param_specs=MODEL_SPECS)
    _assert_same(run, auto)
    batch = awkward_batches(1)[0]
    assert _collectives(run, batch) == _collectives(auto, batch)


# -------------------------------------------------------------- step options, state I/O
def test_model_state_aux_grad_accum_and_rng_equal_the_auto_mesh_run():
    def loss_fn(params, model_state, batch):
        key, count = model_state["key"], model_state["count"]
        keep = jax.random.bernoulli(key, 0.9, batch["x"].shape)
        batch = {**batch, "x": jnp.where(keep, batch["x"], 0.0)}
        aux = {"rows": jnp.int32(batch["x"].shape[0])}
        new = {"key": jax.random.split(key)[0], "count": count + 1}
        return (awkward_loss(params, batch), aux), new

    def run(mesh):
        opt = jzero.ZeroOptimizer(OPTIMIZERS["adamw"](), mesh, stage=3, min_shard_size=1)
        model_state = {"key": jax.random.key(0), "count": jnp.zeros((), jnp.int32)}
        state = opt.init(awkward_params(), model_state=model_state)
        step = opt.train_step(loss_fn, with_model_state=True, has_aux=True, grad_accum=2)
        for batch in awkward_batches(3, batch_size=32):
            state, metrics = step(state, batch)
        return opt, state, metrics

    mesh = _explicit()
    (opt, state, metrics), (auto_opt, auto_state, auto_metrics) = run(mesh), run(_auto(mesh))
    # rows: summed over devices and micro-batches; count: +1 per micro-batch (3 steps x 2)
    assert int(metrics["aux"]["rows"]) == 32 and int(state.model_state["count"]) == 6
    params, auto_params = opt.full_params(state), auto_opt.full_params(auto_state)
    for got, want in [(metrics, auto_metrics), (params, auto_params)]:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(g, w)
    assert jax.random.key_data(state.model_state["key"]).sharding.mesh == mesh
    for x in jax.tree.leaves((metrics, state.model_state["count"])):
        assert x.sharding.mesh == mesh


def test_checkpoint_export_and_offload(tmp_path):
    mesh = _explicit()
    run = Run(mesh, 2, OPTIMIZERS["adam"](), offload="optimizer")
    _assert_optax(run, "adam")
    _assert_typed(run, mesh)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(run.state.opt_state)} == {"pinned_host"}
    with jzero.Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(STEPS, run.state)
        for opt in (run.opt, jzero.ZeroOptimizer(OPTIMIZERS["adam"](), mesh, stage=3)):
            restored = ckpt.restore(opt, awkward_params()).state
            for x in jax.tree.leaves((restored.params, restored.opt_state, restored.step)):
                assert x.sharding.mesh == mesh
            for g, w in zip(
                jax.tree.leaves(opt.full_params(restored)), jax.tree.leaves(run.params)
            ):
                np.testing.assert_array_equal(g, w)
            state, _ = opt.train_step(awkward_loss)(restored, awkward_batches(1)[0])
            assert state.params["emb"].sharding.mesh == mesh
    path = tmp_path / "model.safetensors"
    jzero.checkpoint.export_safetensors(run.opt, run.state, path)
    loaded = jzero.checkpoint.load_safetensors(path, like=awkward_params())
    for k, want in run.params.items():
        np.testing.assert_array_equal(loaded[k], want)


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(jnp.tanh(nn.Dense(16)(x)))


class _NNX(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(40, 16, rngs=rngs), nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


def _mse(pred, batch):
    return jnp.mean((pred - batch["y"]) ** 2)


def test_flax_adapters():
    def linen(mesh):
        variables = _Linen().init(jax.random.key(0), jnp.zeros((1, 40)))
        state = jzero.linen.TrainState.create(
            apply_fn=_Linen().apply,
            variables=variables,
            tx=optax.contrib.muon(1e-2),
            mesh=mesh,
            stage=3,
        )
        loss = lambda params, b: _mse(_Linen().apply({"params": params}, b["x"]), b)
        return state, state.train_step(loss), lambda s: s.params

    def nnx_(mesh):
        state = jzero.nnx.TrainState.create(
            _NNX(nnx.Rngs(0)), tx=optax.contrib.muon(1e-2), mesh=mesh, stage=3
        )
        step = state.train_step(lambda model, b: _mse(model(b["x"]), b))
        return state, step, lambda s: nnx.to_pure_dict(nnx.state(s.model(), nnx.Param))

    mesh = _explicit()
    for make in (linen, nnx_):
        params = []
        for m in (mesh, _auto(mesh)):
            state, step, read = make(m)
            for batch in awkward_batches(3):
                state, _ = step(state, batch)
            params.append(read(state))
            assert all(x.sharding.mesh == m for x in jax.tree.leaves(params[-1]))
        for g, w in zip(*map(jax.tree.leaves, params)):
            np.testing.assert_array_equal(g, w)
