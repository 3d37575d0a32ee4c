"""jzero.report on 8 CPU devices (and 1): collective and model-state bytes, computed by hand."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero import report

N, L, D, B = 8, 4, 64, 16
SCALAR_RING = 2 * 4 * (N - 1) / N  # an all-reduce of one f32 scalar, in the ring model


def _params(model: str) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * shape[-2] ** -0.5
    if model == "weights":  # two matrices per layer: both are used again in backward
        return {"w_in": w(k1, (L, D, 2 * D)), "w_out": w(k2, (L, 2 * D, D))}
    return {"w": w(k1, (L, D, D)), "b": 0.1 * jax.random.normal(k3, (L, D), jnp.float32)}


def _loss_fn(params, batch):
    @jax.checkpoint  # backward re-runs the layer, so stage 3 gathers its params again
    def layer(x_BxD, p):
        p = jzero.gather(p)  # one layer at a time, inside the scan
        if "w" in p:
            return jnp.tanh(x_BxD @ p["w"] + p["b"]), None
        return jnp.tanh(x_BxD @ p["w_in"]) @ p["w_out"], None

    x_BxD, _ = jax.lax.scan(layer, batch["x"], params)
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def _batch() -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (B, D)), "y": jax.random.normal(ky, (B, D))}


def _make(model: str, stage: int, tx: optax.GradientTransformation, devices=None):
    mesh = jzero.data_mesh(devices)
    opt = jzero.ZeroOptimizer(tx, mesh, stage=stage, min_shard_size=1)
    state = opt.init(_params(model))
    assert all(lay.sharded for lay in state.plan.layouts) == (stage > 0 and mesh.size > 1)
    return report(opt.train_step(_loss_fn, manual_gather=True), state, _batch()), state


def _nbytes(shape) -> int:
    return 4 * math.prod(shape)  # every leaf here is f32 (Adam's int32 count too)


@pytest.mark.parametrize("model", ["weights", "bias"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_bytes_match_ring_volumes(stage, model):
    rep, state = _make(model, stage, optax.sgd(0.1))
    params = _params(model)
    S = sum(x.nbytes for x in jax.tree.leaves(params))
    ring = lambda nbytes: nbytes * (N - 1) / N
    # Stages 0-2: all-reduce, or reduce-scatter + all-gather: 2 moves of every byte.
    # Stage 3: gather in forward, again in backward (the layer is rematerialised, so
    # backward re-runs it, bias included), reduce-scatter the gradient: 3 moves.
    expected = (2 if stage < 3 else 3) * ring(S)
    # The scalar all-reduces, counted rather than hidden: the loss mean over 'data', and,
    # from stage 1 on, one per sharded gradient leaf for the global norm in `metrics`.
    scalars = [c for c in rep.collectives if c.shape == ()]
    n_scalars = 1 + (len(state.plan.layouts) if stage > 0 else 0)
    assert [(c.kind, c.dtype, c.trip_count) for c in scalars] == [("all-reduce", "f32", 1)] * (
        n_scalars
    )
    assert rep.comm_bytes["total"] == pytest.approx(expected + n_scalars * SCALAR_RING, abs=1e-6)
    # Per-layer gradient collectives run inside the scan: trip count L each (stage 2's
    # reduce-scatters during backward, stage 3's gathers and reduce-scatters); stages 1-2
    # gather each updated stack of layers a layer at a time too, after the step.
    per_layer = [c for c in rep.collectives if c.shape != () and c.trip_count == L]
    assert bool([c for c in per_layer if c.kind != "all-gather"]) == (stage >= 2)
    if stage == 0:
        assert rep.comm_bytes["all-reduce"] == pytest.approx(expected + SCALAR_RING)
    else:
        assert rep.comm_bytes["reduce-scatter"] == pytest.approx(ring(S))
    assert rep.theory_comm_bytes == pytest.approx((3 if stage == 3 else 2) * ring(S))


@pytest.mark.parametrize("stage", [0, 1, 2, pytest.param(3, marks=pytest.mark.smoke)])
def test_model_state_bytes_match_plan(stage):
    rep, state = _make("bias", stage, optax.adam(1e-3))
    plan = state.plan

    def held(lay, sharded: bool) -> int:
        return _nbytes(lay.padded) // N if sharded and lay.sharded else _nbytes(lay.shape)

    assert rep.params_bytes == sum(held(lay, stage == 3) for lay in plan.layouts)
    assert rep.grads_bytes == sum(held(lay, stage >= 2) for lay in plan.layouts)
    assert rep.opt_bytes == sum(held(lay, stage >= 1) for lay in plan.opt_layouts)
    assert rep.model_state_bytes == rep.params_bytes + rep.grads_bytes + rep.opt_bytes
    # The live arrays agree with the plan's per-shard shapes.
    for x, lay in zip(jax.tree.leaves(state.params), plan.layouts):
        local = list(lay.padded)
        if stage == 3:
            local[lay.dim] //= N
        assert x.addressable_data(0).shape == tuple(local)

    # Theory: Ψ params, 4 + 4 bytes for params and grads, Adam's state / Ψ for the rest.
    psi = L * D * D + L * D
    opt_total = 2 * 4 * psi + 4  # mu, nu and the int32 count
    theory = {0: 8 * psi + opt_total, 1: 8 * psi + opt_total / N, 2: 4 * psi + 4 * psi / N}
    theory[2] += opt_total / N
    theory[3] = (8 * psi + opt_total) / N
    assert rep.num_params == psi
    assert rep.theory_model_state_bytes == pytest.approx(theory[stage])
    # Only Adam's replicated int32 step count keeps the ratio off 1.
    assert rep.model_state_ratio == pytest.approx(1.0, abs=1e-3)


def test_peak_and_serialisation():
    rep, _ = _make("weights", 3, optax.adam(1e-3))
    m = rep.memory
    assert rep.peak_bytes == m["argument"] + m["output"] + m["temp"] - m["alias"] > 0
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["comm_bytes"]["total"] == rep.comm_bytes["total"]
    assert len(d["collectives"]) == len(rep.collectives)
    assert d["comm_ratio"] == pytest.approx(rep.comm_ratio)
    text = str(rep)
    assert "model states" in text and "all-gather" in text and "stage 3" in text
    assert np.isfinite(rep.model_state_ratio) and not rep.notes  # f32: no CPU caveat


def test_mixed_precision_master_weights_count_as_optimizer_state():
    params = {"w": jnp.ones((64, 128), jnp.float32)}
    psi = 64 * 128
    precision = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3, precision=precision)
    state = opt.init(params)
    loss = lambda p, b: jnp.mean((b["x"] @ jzero.gather(p)["w"]).astype(jnp.float32) ** 2)
    rep = report(opt.train_step(loss), state, {"x": jnp.ones((8, 64), jnp.bfloat16)})
    assert rep.params_bytes == 2 * psi // N
    assert rep.opt_bytes == 12 * psi // N + 4  # master + two moments, + Adam's int32 count
    assert rep.model_state_ratio == pytest.approx(1.0, abs=1e-3)  # 2 + 2 + K over N


@pytest.mark.parametrize("stage", [0, 3])
def test_one_device_has_no_comm_ratio_and_no_nan(stage):
    rep, _ = _make("bias", stage, optax.adam(1e-3), devices=jax.devices()[:1])
    assert (rep.devices, rep.comm_bytes["total"], rep.theory_comm_bytes) == (1, 0.0, 0.0)
    assert rep.comm_ratio is None
    assert rep.model_state_ratio == pytest.approx(1.0, abs=1e-3)
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert d["comm_ratio"] is None and d["model_state_ratio"] == rep.model_state_ratio
    text = str(rep)
    assert "nan" not in text.lower()
    assert text.splitlines()[0] == f"jzero stage {stage} on 1 device, {rep.num_params:,} params"
    (comm,) = [line for line in text.splitlines() if line.startswith("comm / step (ring)")]
    assert comm.split()[-3:] == ["0", "0", "-"]
    assert text.splitlines()[-1] == "note: no communication on 1 device, so no comm ratio."


def test_zero_theory_model_states_has_no_ratio():
    rep, _ = _make("bias", 0, optax.sgd(0.1), devices=jax.devices()[:1])
    rep = dataclasses.replace(rep, theory_model_state_bytes=0.0)
    assert rep.model_state_ratio is None
    assert json.loads(json.dumps(rep.to_dict(), allow_nan=False))["model_state_ratio"] is None
    text = str(rep)
    (states,) = [line for line in text.splitlines() if line.startswith("model states")]
    assert states.split()[-2:] == ["0", "-"]
    assert "note: no model states in theory (0 parameters), so no model-state ratio." in text
