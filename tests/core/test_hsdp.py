"""Hybrid sharding (HSDP): model states sharded within a 'data' group, replicated across
'replica'; the batch split over both. Parity with single-device Optax and with plain data
parallelism, shardings, per-axis collective volumes against the ring model, the estimator's
shard group, and the errors."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_text import ALL_REDUCE_MODULE
from _models import (
    awkward_batches,
    awkward_loss,
    awkward_params,
    reference,
    run_steps,
    stacked_batch,
    stacked_loss,
    stacked_params,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero import accounting, estimate, hybrid_mesh, max_params
from jzero.accounting import collectives, mesh_axes
from jzero.cli import main

RTOL, ATOL = 1e-6, 1e-6  # as tests/core/test_parity.py: fp32, sums in another order
DP_RTOL, DP_ATOL = 1e-6, 1e-7  # against plain DP on 8 devices: a few ulps
STEPS = 5
MESHES = [(2, 4), (4, 2)]  # (replicas R, data-group size G)

TXS = {
    "adam": lambda: optax.adam(1e-2),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)
    ),
}


def _train(mesh, stage, tx, *, loss=awkward_loss, batches=None, **step_kw):
    opt = jzero.ZeroOptimizer(tx, mesh, stage=stage, min_shard_size=1)
    state = opt.init(awkward_params())
    step = opt.train_step(loss, **step_kw)
    losses = []
    for batch in batches or awkward_batches(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, state, losses


@functools.cache
def _reference(name):
    return reference(TXS[name](), awkward_params(), awkward_loss, awkward_batches(STEPS))


@functools.cache
def _dp(name):
    opt, state, losses = _train(jzero.data_mesh(), 0, TXS[name]())
    return opt.full_params(state), losses


def _close(got, want, rtol, atol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_single_device_optax_and_dp(stage, shape, name):
    mesh = hybrid_mesh(shape[0])
    assert dict(mesh.shape) == {"replica": shape[0], "data": shape[1]}
    opt, state, losses = _train(mesh, stage, TXS[name]())
    ref = _reference(name)
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    _close(opt.full_params(state), ref.params, RTOL, ATOL)
    _close(opt.full_state(state).opt_state, ref.opt_state, RTOL, ATOL)
    dp_params, dp_losses = _dp(name)  # stage 0 on the flat 8-device 'data' mesh
    np.testing.assert_allclose(losses, dp_losses, rtol=DP_RTOL, atol=DP_ATOL)
    _close(opt.full_params(state), dp_params, DP_RTOL, DP_ATOL)


def test_data_major_mesh_and_a_model_axis():
    # Axis order is free, and a user 'model' axis is left to XLA as on a 1-D mesh.
    ref = _reference("adam")
    for shape, names, specs in [
        ((4, 2), ("data", "replica"), None),
        ((2, 2, 2), ("replica", "data", "model"), {"emb": P("model")}),
    ]:
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
        specs = specs and {k: specs.get(k, P()) for k in awkward_params()}
        opt = jzero.ZeroOptimizer(TXS["adam"](), mesh, stage=3, min_shard_size=1, param_specs=specs)
        state = opt.init(awkward_params())
        step = opt.train_step(awkward_loss)
        state, losses = run_steps(step, state, awkward_batches(STEPS))
        np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
        _close(opt.full_params(state), ref.params, RTOL, ATOL)
        if specs:
            assert state.params["emb"].sharding.spec == P("model", "data")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_accum_model_state_and_aux_average_over_both_axes(stage):
    def loss_fn(params, model_state, batch):
        new = {
            "mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0),
            "count": model_state["count"] + 1,
        }
        return awkward_loss(params, batch), new

    model_state = {"mean": jnp.zeros((40,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    tx = TXS["adam"]
    batches = awkward_batches(3)
    ref = reference(tx(), awkward_params(), loss_fn, batches, model_state=model_state, groups=8)
    opt = jzero.ZeroOptimizer(tx(), hybrid_mesh(2), stage=stage, min_shard_size=1)
    state = opt.init(awkward_params(), model_state=model_state)

    def with_aux(params, model_state, batch):
        loss, new = loss_fn(params, model_state, batch)
        return (loss, {"rows": jnp.int32(batch["x"].shape[0]), "mean_y": batch["y"].mean()}), new

    step = opt.train_step(with_aux, with_model_state=True, has_aux=True)
    for batch in batches:
        state, metrics = step(state, batch)
    assert int(metrics["aux"]["rows"]) == 16  # summed over all 8 devices
    np.testing.assert_allclose(metrics["aux"]["mean_y"], batch["y"].mean(), rtol=1e-6, atol=1e-7)
    mean = state.model_state["mean"]
    np.testing.assert_allclose(mean, ref.model_state["mean"], rtol=1e-6, atol=1e-7)
    assert int(state.model_state["count"]) == 3
    shards = [np.asarray(s.data) for s in mean.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])
    _close(opt.full_params(state), ref.params, RTOL, ATOL)

    # Gradient accumulation: 2 micro-batches per device equal one step on the whole batch.
    batches = awkward_batches(3, batch_size=32)
    ref = reference(tx(), awkward_params(), awkward_loss, batches)
    opt, state, losses = _train(hybrid_mesh(2), stage, tx(), batches=batches, grad_accum=2)
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    _close(opt.full_params(state), ref.params, RTOL, ATOL)


# ------------------------------------------------------------------------------ shardings
@pytest.mark.parametrize("names", [("replica", "data"), ("data", "replica")])
def test_global_batch_splits_the_rows_over_every_batch_axis(names):
    # As the step splits them; across real processes: tests/distributed/test_multiprocess_launch.py.
    mesh = jax.make_mesh(
        (2, 4) if names[0] == "replica" else (4, 2), names, axis_types=(AxisType.Auto,) * 2
    )
    batches = awkward_batches(STEPS)
    placed = [jzero.distributed.global_batch(mesh, b) for b in batches]
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(batches)):
        assert got.sharding == NamedSharding(mesh, P(("replica", "data")))
        assert got.addressable_shards[0].data.shape == (2, *want.shape[1:])  # 16 rows / 8
        np.testing.assert_array_equal(got, want)
    _, state, losses = _train(mesh, 3, TXS["adam"](), batches=placed)
    _, plain_state, plain_losses = _train(mesh, 3, TXS["adam"](), batches=batches)
    assert losses == plain_losses
    _close(state.params, plain_state.params, 0, 0)
    with pytest.raises(ValueError, match=r"split over its 8 devices on \('replica', 'data'\)"):
        jzero.distributed.global_batch(mesh, awkward_batches(1, batch_size=12)[0])


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stored_leaf_is_sharded_over_data_and_replicated_across_replica(stage, shape):
    replicas, group = shape
    mesh = hybrid_mesh(replicas)
    precision = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    opt = jzero.ZeroOptimizer(
        optax.adam(1e-2), mesh, stage=stage, min_shard_size=1, precision=precision
    )
    state = opt.init(awkward_params())
    plan = state.plan
    assert (plan.hybrid, plan.replica_size, plan.data_size) == (True, replicas, group)
    assert plan.dp_size == 8
    assert plan.batch_axes == ("replica", "data")
    stored = [
        (state.params, plan.params),
        (state.opt_state, plan.opt),
        (state.master, plan.master),
    ]
    checked = 0
    for tree, infos in stored:
        for x, info in zip(jax.tree.leaves(tree), infos):
            names = {a for e in x.sharding.spec for a in ((e,) if isinstance(e, str) else e or ())}
            assert "replica" not in names and names <= {"data"}
            assert x.sharding.mesh == mesh and x.sharding.spec == info.spec
            local = list(info.shape)
            if info.partitioned and info.layout.sharded:
                assert names == {"data"}
                local[info.layout.dim] //= group  # G-way shards
                checked += 1
            assert x.addressable_shards[0].data.shape == tuple(local)
            # the same block on every replica: devices differ only in their replica index
            index = x.sharding.devices_indices_map(x.shape)
            for row in mesh.devices:
                assert [index[d] for d in row] == [index[d] for d in mesh.devices[0]]
    assert checked == {0: 0, 1: 5 + 10, 2: 5 + 10, 3: 5 + 10 + 5}[stage]  # master, mu+nu, params


# ------------------------------------------------------------------- collectives per axis
L, D = 4, 64


def _report(stage, replicas, **step_kw):
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), hybrid_mesh(replicas), stage=stage, min_shard_size=1)
    state = opt.init(stacked_params(L, D))
    step = opt.train_step(stacked_loss, manual_gather=True, **step_kw)
    batch = stacked_batch(D, batch_size=16 * step_kw.get("grad_accum", 1))
    return jzero.report(step, state, batch), state


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_axis_comm_bytes_equal_the_ring_model(stage, shape):
    R, G = shape
    rep, state = _report(stage, R)
    S = 4 * (L * D * D + L * D)  # f32
    ring = lambda nbytes, n: nbytes * (n - 1) / n
    # Within 'data': the stage's formula with N = G. Across 'replica': an all-reduce of
    # what the group left each device, its 1/G gradient shard (the whole gradient at 0).
    data = (3 if stage == 3 else 2) * ring(S, G)
    replica = 2 * ring(S / (G if stage else 1), R)
    assert rep.theory_comm_bytes_by_axis == pytest.approx({"data": data, "replica": replica})
    # Scalars, counted: one global-norm all-reduce per sharded gradient leaf within the
    # data group (stages 1-3), and the loss mean over all R·G devices.
    norms = 2 * ring(4, G) * (len(state.plan.layouts) if stage else 0)
    assert rep.comm_bytes_by_axis == pytest.approx(
        {"data": data + norms, "replica": replica, "replica+data": 2 * ring(4, R * G)}, abs=1e-6
    )
    assert rep.theory_comm_bytes == pytest.approx(data + replica)
    assert rep.comm_ratio_by_axis["replica"] == pytest.approx(1.0)
    # Across replicas: all-reduces only, once per step, of the local shards (full grads at 0).
    shapes = [(L, D, D), (L, D)] if stage == 0 else [(L, D // G, D), (L, D // G)]
    across = [
        c for c in rep.collectives if mesh_axes(c, dict(state.plan.mesh.shape)) == ("replica",)
    ]
    assert sorted(c.shape for c in across) == sorted(shapes)
    assert {(c.kind, c.group_size, c.trip_count) for c in across} == {("all-reduce", R, 1)}
    text = str(rep)
    assert text.splitlines()[0].startswith(f"jzero stage {stage} on {R} x {G} devices")
    (line,) = [x for x in text.splitlines() if x.strip().startswith("over replica ")]
    assert line.split()[-1] == "1.0000"
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert d["replicas"] == R and d["comm_bytes_by_axis"]["replica"] == pytest.approx(replica)


@pytest.mark.parametrize("stage", [2, 3])
def test_replica_traffic_is_once_per_step_with_grad_accum(stage):
    # Stages 2/3 reduce-scatter within 'data' every micro-batch; the accumulated shard
    # crosses the replicas once.
    one, _ = _report(stage, 2)
    four, _ = _report(stage, 2, grad_accum=4)
    assert four.comm_bytes_by_axis["replica"] == pytest.approx(one.comm_bytes_by_axis["replica"])
    assert four.comm_bytes_by_axis["data"] > 2 * one.comm_bytes_by_axis["data"]


def test_one_d_mesh_report_has_only_the_data_axis():
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=1, min_shard_size=1)
    state = opt.init(stacked_params(L, D))
    rep = jzero.report(opt.train_step(stacked_loss), state, stacked_batch(D))
    assert not state.plan.hybrid and state.plan.replica_size == 1
    assert set(rep.comm_bytes_by_axis) == {"data"} and rep.replicas == 1
    assert rep.comm_bytes_by_axis["data"] == pytest.approx(rep.comm_bytes["total"])
    assert "over data" not in str(rep)


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("data",)),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("replica",)),
        ("replica_groups={}", ("replica", "data")),
        ("replica_groups=[2,4]<=[8]", ("data",)),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", ("replica",)),
        # XLA's partitioner's form, as printed for the global-norm all-reduce on 2x4:
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
            "{'axis_1'}",
            ("data",),
        ),
        ("replica_groups=mesh['a'=8] {'a':(1)2}", ("replica",)),
        ("replica_groups=maximal_mesh[device_id=3] {}", ()),
    ],
)
def test_groups_are_classified_by_the_mesh_axes_they_span(groups, axes):
    (c,) = collectives(ALL_REDUCE_MODULE.replace("GROUPS", groups))
    assert mesh_axes(c, {"replica": 2, "data": 4}) == axes


# ------------------------------------------------------------------------------ estimator
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_with_a_shard_group_is_the_stage_formula_with_n_replaced_by_g(stage):
    psi, n, g = 7.5e9, 64, 8
    hsdp = estimate(params=psi, devices=n, stage=stage, shard_group=g, largest_layer_params=1e8)
    assert hsdp == estimate(params=psi, devices=g, stage=stage, largest_layer_params=1e8)
    p, gr, opt = 2 * psi, 2 * psi, 12 * psi
    want = {0: p + gr + opt, 1: p + gr + opt / g, 2: p + (gr + opt) / g, 3: (p + gr + opt) / g}
    assert hsdp.model_state_bytes == pytest.approx(want[stage])
    plain = estimate(params=psi, devices=n, stage=stage)
    assert estimate(params=psi, devices=n, stage=stage, shard_group=n) == plain
    fits = max_params(device_memory=80e9, devices=n, stage=stage, shard_group=g)
    assert fits == max_params(device_memory=80e9, devices=g, stage=stage)
    S = 2 * psi
    per_axis = accounting.theory_comm_bytes_per_axis(
        stage=stage, param_bytes_S=S, devices=g, replicas=8
    )
    assert per_axis["data"] == accounting.theory_comm_bytes(stage=stage, param_bytes_S=S, devices=g)
    held = S / (g if stage else 1)  # what the data group leaves each device
    assert per_axis["replica"] == pytest.approx(2 * held * 7 / 8)


def test_cli_shard_group(capsys):
    assert main(["estimate", "--params", "7.5B", "--devices", "64", "--shard-group", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "HSDP: shard group G = 8 x 8 replicas" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert [rows[s][-1] for s in "0123"] == ["120.00", "41.25", "28.12", "15.00"]
    argv = ["estimate", "--params", "7.5B", "--devices", "64", "--shard-group", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["shard_group"] == 8
    assert out["estimates"][3]["model_state_bytes"] == 15e9
    assert main(["estimate", "--params", "7.5B", "--devices", "64", "--shard-group", "6"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "shard_group must divide devices: 6 does not divide 64" in line


# --------------------------------------------------------------------------------- errors
def test_bad_inputs_name_the_problem_and_the_fix():
    mesh = jax.make_mesh((2, 4), ("replica", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="a 'replica' axis but no 'data' axis.*hybrid_mesh"):
        jzero.ZeroOptimizer(optax.adam(1e-2), mesh, stage=3)
    with pytest.raises(ValueError, match="hybrid_mesh\\(3\\) needs a device count divisible"):
        hybrid_mesh(3)
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        hybrid_mesh(0)
    specs = {k: P("replica") if k == "w1" else P() for k in awkward_params()}
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), hybrid_mesh(2), stage=3, param_specs=specs)
    with pytest.raises(ValueError, match=r"param \['w1'\].*names the 'replica' axis"):
        opt.init(awkward_params())
    # 12 rows split over the 4-device data group, but not over all 2 x 4 devices.
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), hybrid_mesh(2), stage=3)
    state = opt.init(awkward_params())
    with pytest.raises(ValueError, match=r"divisible by\D*8\b"):
        opt.train_step(awkward_loss)(state, awkward_batches(1, batch_size=12)[0])
