"""hpZ (``Communication(hpz=G)``, ZeRO++'s secondary partition): stage 3 gathers each
parameter across the groups of G devices once, in forward, and within the group in forward
and backward. Parity with single-device Optax, the per-axis collective bytes of the
compiled step against the ring-model theory (report and estimator), the secondary copies'
memory, and the errors. Across real processes: test_hpz_across_processes (slow)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    awkward_batches,
    awkward_loss,
    awkward_params,
    make_tx,
    reference,
    run_steps,
    stacked_batch,
    stacked_loss,
    stacked_params,
)
from _multiprocess import run_processes
from _paths import WORKERS
from jax.sharding import PartitionSpec as P

import jzero
from jzero import Communication, estimate, hybrid_mesh
from jzero.accounting import ACROSS, WITHIN, theory_comm_bytes_hpz
from jzero.core.comm.gatherer import Gatherer, Sharded
from jzero.core.comm.reducer import Reducer
from jzero.core.options.communication import Quant

RTOL, ATOL = 1e-6, 1e-6  # as tests/core/test_parity.py: fp32, sums in another order
STEPS = 3
LAYERS, WIDTH = 4, 64
WORKER = WORKERS / "mp_hpz_worker.py"
ROBUST_TX = functools.partial(make_tx, eps=1e-3)  # where two programs' rounding differs more


def _close(got, want, rtol=RTOL, atol=ATOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _train(mesh, params, loss, batches, *, comm, precision=None, tx=make_tx, **step_kw):
    opt = jzero.ZeroOptimizer(tx(), mesh, stage=3, min_shard_size=1, comm=comm, precision=precision)
    state = opt.init(params)
    step = opt.train_step(loss, **step_kw)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, state, losses


block = jzero.remat_layer(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]))


def remat_layer_loss(params, batch):
    x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


MODELS = {  # name -> (params, loss, batches, manual_gather)
    "mlp": (awkward_params, awkward_loss, lambda: awkward_batches(STEPS), False),
    "mlp_manual": (awkward_params, awkward_loss, lambda: awkward_batches(STEPS), True),
    "scan": (stacked_params, stacked_loss, lambda: [stacked_batch()] * STEPS, False),
    "scan_remat_layer": (stacked_params, remat_layer_loss, lambda: [stacked_batch()] * STEPS, True),
}
# The stacked model's smallest gradient is 7e-8 (of 16384 weights; the median 2e-3), below
# make_tx's eps of 1e-6: Adam turns its rounding noise into +-lr updates (docs/design.md,
# "Traps"), which XLA 0.12's summation order shows. Its eps is 1e-3, far above that noise.
SGD = functools.partial(optax.sgd, 0.1)
TXS = {"mlp": make_tx, "mlp_manual": make_tx, "scan": ROBUST_TX, "scan_remat_layer": ROBUST_TX}


@functools.cache
def _reference(model, tx=None):
    params, loss, batches, _ = MODELS[model]
    return reference((tx or TXS[model])(), params(), loss, batches())


# ------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("replicas, hpz", [(1, 2), (1, 4), (2, 2)], ids=["8/G2", "8/G4", "2x4/G2"])
def test_matches_single_device_optax(model, replicas, hpz):
    params, loss, batches, manual = MODELS[model]
    mesh = jzero.data_mesh() if replicas == 1 else hybrid_mesh(replicas)
    comm = Communication(hpz=hpz)
    opt, state, losses = _train(
        mesh, params(), loss, batches(), comm=comm, manual_gather=manual, tx=TXS[model]
    )
    ref = _reference(model)
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    _close(opt.full_params(state), ref.params)
    _close(opt.full_state(state).opt_state, ref.opt_state)
    # stored as without hpZ: 1/N shards over 'data' (the secondary copies live in a step)
    for x, stored in zip(jax.tree.leaves(state.params), state.plan.params):
        assert x.sharding.spec == stored.spec
        if stored.layout.sharded:  # all but the scalar
            assert (
                x.addressable_data(0).shape[stored.layout.dim] * 4
                == stored.shape[stored.layout.dim] * 4 // mesh.shape["data"]
            )


def _gathered(hpz, quant, bucket):
    """Every leaf of the awkward model as stage 3's gather hands it to the loss."""
    mesh, params = jzero.data_mesh(), awkward_params()
    opt = jzero.ZeroOptimizer(make_tx(), mesh, stage=3, min_shard_size=1)
    state = opt.init(params)
    lays = state.plan.layouts
    quant = None if quant is None else Quant(quant, 256)

    def gather(*shards):
        sinks = [jnp.zeros_like(x) for x in shards]
        handles = [
            Sharded(s, x, lay, Gatherer(True, quant, bucket, hpz), Reducer(s.dtype))
            if lay.sharded
            else x  # the scalar
            for s, x, lay in zip(sinks, shards, lays)
        ]
        return jzero.gather(handles)

    leaves = jax.tree.leaves(state.params)
    specs = [stored.data_spec for stored in state.plan.params]
    run = jax.shard_map(gather, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)
    return jax.jit(run)(*leaves), jax.tree.leaves(params)


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
@pytest.mark.parametrize("hpz", [2, 4])
@pytest.mark.parametrize("bucket", [False, True], ids=["leaf", "bucket"])
def test_gathered_values_are_those_without_hpz_bit_for_bit(quant, hpz, bucket):
    # Quantized: each device quantizes its own shard as a plain quantized gather does, and
    # the group's gather moves the dequantized values exactly.
    got, true = _gathered(hpz, quant, bucket)
    want, _ = _gathered(None, quant, bucket)
    for g, w, t in zip(got, want, true, strict=True):
        assert g.shape == t.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        if quant is None:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(t))


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_training_matches_quantized_training_without_hpz(quant):
    # The gathered values are equal (above), but XLA orders the layers' matmul sums
    # differently; Adam's eps is large enough that it does not turn that rounding noise
    # in near-zero gradients into +-lr updates (tests/_models.py make_tx).
    runs = [
        _train(
            jzero.data_mesh(),
            stacked_params(),
            stacked_loss,
            [stacked_batch()] * STEPS,
            comm=Communication(hpz=hpz, gather_quant=quant),
            tx=ROBUST_TX,
        )  # fmt: skip
        for hpz in (None, 2)
    ]
    (opt, plain, plain_losses), (_, hpz, hpz_losses) = runs
    np.testing.assert_allclose(hpz_losses, plain_losses, rtol=RTOL, atol=ATOL)
    _close(opt.full_params(hpz), opt.full_params(plain))


# -------------------------------------------------------------- bytes: HLO against theory
def weights_only(layers=LAYERS, width=WIDTH):
    """Stacked square weights, no biases: backward needs every weight (a bias's gradient
    needs no bias, so XLA would drop its backward gather and break an exact count)."""
    w = jax.random.normal(jax.random.key(0), (layers, width, width), jnp.float32)
    return {"layers": {"w": w / np.sqrt(width)}}


def weights_only_loss(params, batch):
    x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w["w"]), None), batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


def _report(mesh, hpz, gather_quant=None, bucket=False):
    comm = Communication(hpz=hpz, gather_quant=gather_quant, bucket=bucket)
    opt = jzero.ZeroOptimizer(make_tx(), mesh, stage=3, min_shard_size=1, comm=comm)
    state = opt.init(weights_only())
    step = opt.train_step(weights_only_loss)
    return jzero.report(step, state, stacked_batch())


SCALARS = 64  # bytes: the loss mean and the update's norms, all-reduced over 'data'


@pytest.mark.parametrize("replicas, hpz", [(1, 2), (1, 4), (2, 2)], ids=["8/G2", "8/G4", "2x4/G2"])
def test_bytes_per_axis_equal_theory(replicas, hpz):
    mesh = jzero.data_mesh() if replicas == 1 else hybrid_mesh(replicas)
    n = mesh.shape["data"]
    rep = _report(mesh, hpz)
    s = LAYERS * WIDTH * WIDTH * 4  # f32, no padding
    theory = theory_comm_bytes_hpz(param_bytes_S=s, devices=n, group=hpz, replicas=replicas)
    assert rep.hpz == hpz and rep.theory_comm_bytes_by_axis == theory
    measured = rep.comm_bytes_by_axis
    assert measured[ACROSS] == theory[ACROSS] == s * (n // hpz - 1) / n  # forward only
    assert measured[WITHIN] == theory[WITHIN] == 2 * s * (hpz - 1) / hpz  # and backward
    assert theory["data"] <= measured["data"] <= theory["data"] + SCALARS  # reduce-scatter
    if replicas > 1:
        assert theory["replica"] <= measured["replica"] <= theory["replica"] + SCALARS
    # besides: the loss mean over both batch axes (hybrid), a few scalar bytes
    assert set(measured) - set(theory) <= {"replica+data"}
    assert measured.get("replica+data", 0) <= SCALARS
    # across the groups a step gathers the parameters once, where plain stage 3 gathers
    # them twice over the whole axis
    plain = _report(mesh, None).comm_bytes["all-gather"]
    assert plain == 2 * s * (n - 1) / n
    assert rep.comm_bytes["all-gather"] == theory[ACROSS] + theory[WITHIN]
    assert "over data(across)" in str(rep) and f"hpZ groups of {hpz}" in str(rep)


@pytest.mark.parametrize("bucket", [False, True])
def test_quantized_bytes_cross_the_groups_and_exact_bytes_stay_within(bucket):
    hpz, n, block = 2, 8, 256
    rep = _report(jzero.data_mesh(), hpz, "int8", bucket)
    shard = WIDTH * WIDTH // n  # elements per device and layer: 2 blocks of 256
    row = shard + 4 * -(-shard // block)  # int8 values + fp32 scales
    s_quant = LAYERS * n * row
    theory = theory_comm_bytes_hpz(param_bytes_S=s_quant, devices=n, group=hpz)
    assert rep.comm_bytes_by_axis[ACROSS] == theory[ACROSS]
    s = LAYERS * WIDTH * WIDTH * 4
    assert rep.comm_bytes_by_axis[WITHIN] == 2 * s * (hpz - 1) / hpz  # dequantized fp32
    across = [c for c in rep.collectives if c.kind == "all-gather" and c.group_size == n // hpz]
    assert {c.dtype for c in across} == {"s8", "f32"}


@pytest.mark.parametrize("hpz", [2, 4])
def test_secondary_copies_are_the_memory_the_estimator_adds(hpz):
    # Forward keeps each layer's secondary copy (1/G of it) for backward: the compiled
    # temp grows by Psi * 4 / G, plus at most one layer's gathered copy (buffers).
    temp = lambda r: r.memory["temp"]
    rep, plain = _report(jzero.data_mesh(), hpz), _report(jzero.data_mesh(), None)
    psi = LAYERS * WIDTH * WIDTH
    est = estimate(params=psi, devices=8, stage=3, precision="fp32", hpz=hpz)
    assert est.secondary_bytes == rep.secondary_bytes == psi * 4 / hpz
    assert est.total_bytes == estimate(params=psi, devices=8, stage=3, precision="fp32")\
        .total_bytes + psi * 4 / hpz  # fmt: skip
    grown = temp(rep) - temp(plain)
    print(f"hpz={hpz}: temp +{grown} B, secondary copies {est.secondary_bytes:.0f} B")
    assert est.secondary_bytes <= grown <= est.secondary_bytes + WIDTH * WIDTH * 4


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "hpz, error",
    [
        (1, r"hpz must be None or an int >= 2 .* got 1"),
        (True, r"hpz must be None or an int >= 2 .* got True"),
        ("8", r"hpz must be None or an int >= 2 .* got '8'"),
    ],
)
def test_a_group_size_that_is_no_size_is_refused(hpz, error):
    with pytest.raises(ValueError, match=error):
        Communication(hpz=hpz)


@pytest.mark.parametrize(
    "mesh, hpz, kw, error",
    [
        ("8", 3, {}, r"hpz=3\) needs groups of 3 devices .* data axis of 8 .* hpz=one of \[2, 4\]"),
        ("8", 8, {}, r"hpz=8\) .* into more than one group; use hpz=one of \[2, 4\]"),
        ("2x4", 4, {}, r"hpz=4\) .* data axis of 4 .* use hpz=one of \[2\]"),
        ("8", 2, {"stage": 2}, r"hpz=2\) keeps stage 3's .* stage 2 gathers no parameters"),
        ("8", 2, {"prefetch": True}, r"prefetching scans do not keep hpZ's secondary"),
    ],
)
def test_a_group_size_the_optimizer_cannot_use_is_refused_when_it_is_built(mesh, hpz, kw, error):
    mesh = jzero.data_mesh() if mesh == "8" else hybrid_mesh(2)
    stage = kw.pop("stage", 3)
    with pytest.raises(ValueError, match=error):
        jzero.ZeroOptimizer(optax.sgd(0.1), mesh, stage=stage, comm=Communication(hpz=hpz, **kw))


def test_a_model_axis_is_left_alone():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {k: P() for k in awkward_params()} | {"emb": P("model")}
    # SGD: the model axis sums x @ emb in another order, and w1[4, 4]'s first gradient is
    # 4e-5 (median 0.2), a cancellation whose rounding Adam would scale up to ~lr
    opt = jzero.ZeroOptimizer(
        SGD(), mesh, stage=3, min_shard_size=1, param_specs=specs,
        comm=Communication(hpz=2),
    )  # fmt: skip
    state = opt.init(awkward_params())
    step = opt.train_step(awkward_loss)
    state, losses = run_steps(step, state, awkward_batches(STEPS))
    ref = _reference("mlp", SGD)
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL, atol=ATOL)
    _close(opt.full_params(state), ref.params)
    assert state.params["emb"].sharding.spec == P("model", "data")


# ----------------------------------------------------------------------- real processes
@pytest.mark.slow  # real processes: in CI (-m ''), not in the quick default run
def test_hpz_across_processes(tmp_path):
    # 2 processes x 4 devices, groups of 4 = one process: the across-group gather is the
    # only parameter gather that crosses processes (gloo), and it runs once per step.
    out = tmp_path / "out"
    results = run_processes(WORKER, 2, str(out), local_devices=4, timeout=300)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    runs = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(2)]
    assert runs[0] == runs[1]
    run = runs[0]
    batches = [stacked_batch()] * STEPS
    ref = reference(ROBUST_TX(), stacked_params(), stacked_loss, batches)  # as the worker's
    np.testing.assert_allclose(run["losses"], ref.losses, rtol=1e-5, atol=ATOL)
    for name, want in ref.params["layers"].items():
        got = np.asarray(run["params"][name], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=ATOL, err_msg=name)
    s = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    theory = theory_comm_bytes_hpz(param_bytes_S=s, devices=8, group=4)
    assert run["by_axis"][ACROSS] == theory[ACROSS]  # across processes: forward only
    # within a process: forward's gathers and backward's (remat_layer recomputes the layer)
    assert run["by_axis"][WITHIN] == theory[WITHIN]
    across = run["across_groups"]
    assert across and all(sorted({d // 4 for d in g}) == [0, 1] for g in across)
