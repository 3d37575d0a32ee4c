"""Prefetch (``Communication(prefetch=True)``): stage 3 gathers layer i+1 while computing
layer i, and in backward layer i-1 while differentiating layer i.

Checked on a loss written as for one device (a ``lax.scan`` / ``nn.scan`` over stacked
layers): the lowered program's loop bodies issue the next layer's all-gathers and compute
with the layer gathered one step earlier; every weight is still gathered 2 x layers
times; the compiled peak holds at most one layer more than the same loop without
prefetch (the estimator's prefetch term); values equal single-device Optax. Activations
are kept by default (the dot FLOPs of the step without prefetch, no forward recomputed);
``StepOptions(remat_policy=nothing_saveable)`` recomputes each layer's forward instead,
with or without prefetch (more FLOPs, less temp memory).
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo_text import all_gathers, loop_bodies
from _models import reference, regression_batches, run_steps

import jzero
from jzero.accounting import dot_flops

N, L, D, H, B, STEPS = 8, 6, 128, 512, 64, 3
LAYER_BYTES = 4 * 2 * D * H  # one layer's gathered fp32 weights
# eps above the smallest gradients (1.5e-10 up; median 4e-3; 1.3 % of w1's below 1e-4), so
# Adam does not scale their rounding noise up to +-lr (docs/design.md, "Traps")
TX = lambda: optax.adam(1e-3, eps=1e-3)
RECOMPUTE = jzero.StepOptions(remat_policy=jax.checkpoint_policies.nothing_saveable)
MATMUL = 2 * (B // N) * D * H  # FLOPs of one layer's x @ w1 (or its transpose) per device


def mlp(p, x_BxD):
    return x_BxD + jnp.tanh(x_BxD @ p["w1"]) @ p["w2"]


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "layers": {
            "w1": jax.random.normal(k1, (L, D, H), jnp.float32) / 8,
            "w2": jax.random.normal(k2, (L, H, D), jnp.float32) / 16,
        }
    }


def scan_loss(params, batch):
    x_BxD, _ = jax.lax.scan(lambda x, p: (mlp(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


recompute = jzero.remat_layer(mlp)  # per-layer gathering by hand, full recompute


def manual_loss(params, batch):
    x_BxD, _ = jax.lax.scan(lambda x, p: (recompute(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def batches(steps=STEPS):
    return regression_batches(steps, B, D)


def _step(mode: str):
    """``mode``: 'default', 'recompute' (its remat_policy=nothing_saveable), 'manual'
    (remat_layer by hand), 'prefetch' (+ '_bucket', '_recompute')."""
    comm = jzero.Communication(prefetch=mode.startswith("prefetch"), bucket=mode.endswith("bucket"))
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=3, comm=comm)
    state = opt.init(params())
    if mode == "manual":
        return opt, state, opt.train_step(manual_loss, manual_gather=True)
    if mode.endswith("recompute"):
        return opt, state, opt.train_step(scan_loss, RECOMPUTE)
    return opt, state, opt.train_step(scan_loss)


@functools.cache
def compiled(mode: str):
    _, state, step = _step(mode)
    return step.lower(state, batches(1)[0]).compile()


def _peak(mode: str) -> int:
    mem = compiled(mode).memory_analysis()
    return mem.argument_size_in_bytes + mem.temp_size_in_bytes


def test_loop_bodies_gather_the_next_layer_and_compute_with_the_previous_gather():
    _, state, step = _step("prefetch")
    text = step.lower(state, batches(1)[0]).as_text()
    prefetching = 0
    for body in loop_bodies(text):
        gathered = set(re.findall(r"(%[\w#]+) = \"stablehlo.all_gather\"", body))
        dots = re.findall(r"stablehlo.dot_general (%[\w#]+), (%[\w#]+)", body)
        if gathered and dots:
            # A loop step: the all-gathers come first, and no matmul uses what they gather
            # (that is the next layer's, carried to the next step).
            assert body.index("stablehlo.all_gather") < body.index("stablehlo.dot_general")
            assert not gathered & {x for dot in dots for x in dot}, body
            prefetching += 1
    assert prefetching == 2  # the forward loop's step and the backward loop's


def _temp(mode: str) -> int:
    return compiled(mode).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", ["prefetch", "prefetch_bucket", "prefetch_recompute"])
def test_every_weight_is_still_gathered_twice_per_layer(mode):
    if not mode.endswith("bucket"):
        for shape in [(D, H), (H, D)]:
            assert all_gathers(compiled(mode), shape) == 2 * L
    else:  # one flat all-gather per layer and pass
        assert all_gathers(compiled(mode), (N, 2 * D * H // N)) == 2 * L


def test_peak_holds_at_most_one_layer_more():
    est = lambda prefetch: jzero.estimate(
        params=2 * L * D * H, devices=N, stage=3, precision="fp32",
        largest_layer_params=2 * D * H, prefetch=prefetch,
    ).total_bytes  # fmt: skip
    term = est(True) - est(False)
    assert term == LAYER_BYTES
    recompute, manual = _peak("prefetch_recompute"), _peak("manual")
    print(f"peak: prefetch recomputing {recompute:,} B, per-layer full recompute {manual:,} B")
    # The same recompute, one layer gathered ahead: exactly the estimator's term on XLA
    # 0.10; XLA:CPU 0.11+ holds 1.29 layers (675,928 B against 524,288), still under two
    assert 0 < recompute - manual <= 2 * term
    assert _peak("prefetch") <= _peak("default") + term  # both keep the activations


def test_prefetch_keeping_activations_recomputes_no_forward():
    """Dot FLOPs per device and step, loop trip counts included (``cost_analysis`` counts
    a loop body once, and prefetch peels each loop's last layer off)."""
    flops = {m: dot_flops(compiled(m).as_text()) for m in ("default", "prefetch")}
    for m in ("recompute", "prefetch_recompute"):
        flops[m] = dot_flops(compiled(m).as_text())
    print(flops)
    assert flops["default"] == 3 * L * 2 * MATMUL  # forward, and backward's two per matmul
    # Prefetch's peeled first layer needs no input gradient (the batch is not
    # differentiated) and XLA drops that one matmul; nothing else differs.
    assert flops["prefetch"] == flops["default"] - MATMUL
    # Recomputing: each layer's x @ w1 again (tanh's derivative needs it; the second
    # matmul's output is not needed in backward), with or without prefetch.
    assert flops["prefetch_recompute"] == flops["prefetch"] + L * MATMUL
    assert flops["recompute"] == flops["default"] + L * MATMUL


def test_keeping_activations_takes_more_temp_memory_than_recomputing():
    temp = {m: _temp(m) for m in ("default", "recompute", "prefetch", "prefetch_recompute")}
    print(temp)
    # kept: each layer's x @ w1 and tanh of it, [B/N, H] fp32 (more with XLA's copies)
    kept = L * 2 * (B // N) * H * 4
    assert temp["prefetch"] - temp["prefetch_recompute"] >= kept
    assert temp["default"] - temp["recompute"] >= kept


@pytest.mark.parametrize("mode", ["prefetch", "prefetch_bucket", "prefetch_recompute", "recompute"])
def test_prefetch_matches_single_device_optax(mode):
    ref = reference(TX(), params(), scan_loss, batches())
    opt, state, step = _step(mode)
    state, losses = run_steps(step, state, batches())
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "stage, options, fix",
    [
        (2, RECOMPUTE, "use stage=3"),
        (3, jzero.StepOptions(manual_gather=True, remat_policy=RECOMPUTE.remat_policy),
         "jzero.remat_layer"),
    ],
)  # fmt: skip
def test_a_remat_policy_with_nothing_to_act_on_is_refused(stage, options, fix):
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=stage)
    with pytest.raises(ValueError, match=fix):
        opt.train_step(scan_loss, options)
    with pytest.raises(TypeError, match="nothing_saveable"):
        jzero.StepOptions(remat_policy="nothing_saveable")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x_BxD, _):
        h_BxH = nn.gelu(nn.Dense(H)(nn.LayerNorm()(x_BxD)))
        return x_BxD + nn.Dense(D)(h_BxH), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x_BxD):
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        return blocks()(x_BxD, None)[0]


def test_linen_nn_scan_with_prefetch_matches_single_device_optax():
    x = batches(1)[0]["x"]
    variables = Model().init(jax.random.key(0), x)
    loss = lambda p, batch: jnp.mean((Model().apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
    state = jzero.linen.TrainState.create(
        apply_fn=Model().apply,
        variables=variables,
        tx=TX(),
        mesh=jzero.data_mesh(),
        stage=3,
        comm=jzero.Communication(prefetch=True, bucket=True),
    )
    step = state.train_step(loss)
    ref = reference(TX(), variables["params"], loss, batches())
    for batch, want in zip(batches(), ref.losses):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def embedded_params():
    return {**params(), "embed": jax.random.normal(jax.random.key(3), (D, D)) / 8}


def embedded_loss(params, batch):
    # An input projection before the scan, as a language model's embedding: the scan's
    # input is differentiated, so every layer's input gradient is needed, prefetch or not.
    return scan_loss(params, {**batch, "x": batch["x"] @ params["embed"]})


@functools.cache
def compiled_embedded(prefetch: bool):
    comm = jzero.Communication(prefetch=prefetch)
    opt = jzero.ZeroOptimizer(TX(), jzero.data_mesh(), stage=3, comm=comm)
    state = opt.init(embedded_params())
    return opt.train_step(embedded_loss).lower(state, batches(1)[0]).compile()


def test_prefetch_keeping_activations_has_the_dot_flops_of_the_step_without():
    # Above, the batch feeds the first layer directly and prefetch's peeled first layer
    # drops that layer's unneeded input gradient (1 matmul of 6 L: 2.8 % at L = 6). With
    # the scan's input differentiated nothing is dropped: the same matmuls exactly.
    without, with_prefetch = (dot_flops(compiled_embedded(p).as_text()) for p in (False, True))
    embed = 2 * (B // N) * D * D  # x @ embed forward and its weight gradient
    assert without == 3 * L * 2 * MATMUL + 2 * embed
    assert with_prefetch == without
