"""Stage 3 per-layer gathering with activations kept: ``remat_layer(fn, policy=...)``.

8 layers of (256x1024, 1024x256), Adam, 8 devices. With
``policy=jax.checkpoint_policies.everything_saveable`` stage 3 keeps each layer's
activations from forward (no forward recomputation, FSDP's trade) but still gathers every
weight again in backward; ``policy=None`` recomputes the whole layer, as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import reference, run_steps

import jzero
from jzero.accounting import collectives, dot_flops

N, L, D, H, B = 8, 8, 256, 1024, 64  # devices, layers, width, hidden, global batch
KEEP = jax.checkpoint_policies.everything_saveable


def mlp(p, x_BxD):
    return x_BxD + jnp.tanh(x_BxD @ p["w1"]) @ p["w2"]


BLOCKS = {
    "recompute": jzero.remat_layer(mlp),  # default: re-gather and recompute the layer
    "keep": jzero.remat_layer(mlp, policy=KEEP),  # re-gather, activations kept
    # The default step (no manual_gather): gathered per layer, scanned or unrolled
    # (test_autogather.py, test_unrolled_stage3.py), activations kept.
    "default": mlp,
    "whole": mlp,  # the whole model gathered once, up front (jzero.gather(params))
}


def make_params(scanned: bool):
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = jax.random.normal(k1, (L, D, H), jnp.float32) / 16
    w2 = jax.random.normal(k2, (L, H, D), jnp.float32) / 32
    if scanned:
        return {"layers": {"w1": w1, "w2": w2}}
    return {"layers": [{"w1": w1[i], "w2": w2[i]} for i in range(L)]}


def make_loss(block, scanned: bool):
    def loss_fn(params, batch):
        x_BxD = batch["x"]
        if scanned:
            x_BxD, _ = jax.lax.scan(lambda x, p: (block(p, x), None), x_BxD, params["layers"])
        else:
            for p in params["layers"]:  # a plain Python loop over layers
                x_BxD = block(p, x_BxD)
        return jnp.mean((x_BxD - batch["y"]) ** 2)

    return loss_fn


def _batch():
    kx, ky = jax.random.split(jax.random.key(3))
    return {"x": jax.random.normal(kx, (B, D)), "y": jax.random.normal(ky, (B, D)) * 0.5}


SCANNED = {"unrolled": False, "scanned": True}


@functools.cache
def _compiled(mode: str, model: str, stage: int = 3):
    scanned = SCANNED[model]
    opt = jzero.ZeroOptimizer(optax.adam(1e-3), jzero.data_mesh(), stage=stage)
    state = opt.init(make_params(scanned))
    loss = make_loss(BLOCKS[mode], scanned)
    if mode == "whole":
        loss = lambda params, batch, per_layer=loss: per_layer(jzero.gather(params), batch)
    step = opt.train_step(loss, manual_gather=mode != "default")
    return step.lower(state, _batch()).compile()


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def _peak(compiled) -> int:
    mem = compiled.memory_analysis()
    return mem.argument_size_in_bytes + mem.temp_size_in_bytes


def _gathers(compiled) -> dict[tuple[int, ...], int]:
    """All-gathers per step, by gathered shape (trip counts included)."""
    out = {}
    for c in collectives(compiled.as_text()):
        if c.kind == "all-gather":
            out[c.shape] = out.get(c.shape, 0) + c.trip_count
    return out


def test_keeping_activations_costs_the_whole_gather_flops():
    # cost_analysis counts everything in the unrolled model (no loops). It also counts
    # the layout copy XLA:CPU adds after each all-gather: the backward re-gathers add L
    # such copies per weight (1.5% here), no arithmetic; matmuls are compared exactly below.
    keep, whole = _flops(_compiled("keep", "unrolled")), _flops(_compiled("whole", "unrolled"))
    regather_copies = L * 2 * D * H
    assert abs(keep - regather_copies - whole) <= 0.01 * whole, (keep, whole)
    assert _flops(_compiled("recompute", "unrolled")) > 1.1 * whole  # the forward again


@pytest.mark.parametrize("model", sorted(SCANNED))
def test_keeping_activations_costs_the_whole_gather_matmuls(model):
    # Matmul FLOPs with loop trip counts, so the scanned model is counted in full too.
    dots = {m: dot_flops(_compiled(m, model).as_text()) for m in BLOCKS}
    first_matmul = 2 * (B // N) * D * H  # x@w1, per device
    assert abs(dots["keep"] - dots["whole"]) <= 0.01 * dots["whole"], dots
    # Full recompute: every layer's x@w1 once more (backward needs tanh(x@w1), not the
    # layer's output, so XLA drops the recomputed h@w2).
    assert dots["recompute"] == dots["whole"] + L * first_matmul, dots


@pytest.mark.parametrize("model", sorted(SCANNED))
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_backward_gathers_every_weight_again(model, mode):
    gathers = _gathers(_compiled(mode, model))
    assert set(gathers) == {(D, H), (H, D)}  # per-layer gathers only
    assert gathers[(H, D)] == 2 * L
    # The first layer's input is the batch (no cotangent wanted), so with its activations
    # kept the unrolled model's backward has no use for its w1; a scan body is one
    # program for every layer, and recomputation needs w1 in every layer.
    first_w1_unused = mode == "keep" and model == "unrolled"
    assert gathers[(D, H)] == 2 * L - first_w1_unused


@pytest.mark.parametrize("model", sorted(SCANNED))
def test_peak_grows_by_about_the_saved_activations(model):
    keep, recompute = _peak(_compiled("keep", model)), _peak(_compiled("recompute", model))
    default, whole = _peak(_compiled("default", model)), _peak(_compiled("whole", model))
    print(f"{model}: peak recompute {recompute:,} keep {keep:,} default step {default:,}")
    assert recompute < keep < whole  # the whole-model gather holds every gathered weight
    assert default <= keep  # the default step gathers per layer too, activations kept


@pytest.mark.parametrize("model", sorted(SCANNED))
def test_keep_matches_single_device_optax_and_recompute(model):
    scanned = SCANNED[model]
    batches = [_batch()] * 3
    tx = lambda: optax.adam(1e-3, eps=1e-4)  # eps above gradient rounding noise
    ref = reference(tx(), make_params(scanned), make_loss(mlp, scanned), batches)
    finals = {}
    for mode in ("keep", "recompute"):
        opt = jzero.ZeroOptimizer(tx(), jzero.data_mesh(), stage=3)
        state = opt.init(make_params(scanned))
        step = opt.train_step(make_loss(BLOCKS[mode], scanned), manual_gather=True)
        state, losses = run_steps(step, state, batches)
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-6, atol=1e-6)
        finals[mode] = jax.tree.leaves(opt.full_params(state))
        for a, b in zip(finals[mode], jax.tree.leaves(ref.params)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(finals["keep"], finals["recompute"]):
        np.testing.assert_array_equal(a, b)  # bitwise


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_with_policy_match_single_device_optax(stage):
    # Outside stage 3 remat_layer is jax.checkpoint(fn, policy=policy), as before.
    batches = [_batch()] * 2
    tx = lambda: optax.adam(1e-3, eps=1e-4)
    ref = reference(tx(), make_params(False), make_loss(mlp, False), batches)
    opt = jzero.ZeroOptimizer(tx(), jzero.data_mesh(), stage=stage)
    state = opt.init(make_params(False))
    step = opt.train_step(make_loss(BLOCKS["keep"], False), manual_gather=True)
    for batch in batches:
        state, _ = step(state, batch)
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
