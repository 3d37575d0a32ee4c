"""fp8 stage-3 all-gathers (``Communication(gather_quant='fp8')``: float8_e4m3fn values with
one fp32 scale ``absmax / 448`` per block).

Each element round-trips within half e4m3's spacing at ``|x| / scale`` (checked element by
element in e4m3's normal and subnormal ranges, and reached); the wire carries the values
as u8 bytes: 0.25x the fp32 gathers' payload (0.5x bf16's), plus int8's fp32 scales, while
the reduce-scatters stay as they were; a step's gradient is that of the loss at the
dequantized parameters on every gathering path (per layer, bucketed, prefetched, manual
``jzero.gather``, ``remat_layer``), and each step of a few along each path has its loss
within the first-order bound of the exact loss at the same parameters; so does one step
of the example LM from states along its exact run. Scales per block are measured against
one per tensor, and fp8 against int8. No test compares the end of an fp8 run with an
exact one: those trajectories are chaotic (tests/_lm.py; scripts/accuracy.py measures
the final loss over seeds).
"""

from __future__ import annotations

import dataclasses
import functools

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _lm import (
    LM_STEPS,
    ON_THE_EXACT_RUN,
    SNAPSHOTS,
    TRAINED,
    exact_snapshot,
    final,
    lm_losses,
    sgd_step,
)
from _lm import value_and_grad as lm_value_and_grad
from _models import (
    awkward_batches,
    awkward_loss,
    awkward_params,
    stacked_batch,
    stacked_loss,
    stacked_params,
)
from _quantized_gather import SHAPES, abs_dot, check_gathers, dequantized

import jzero
from jzero.accounting import collectives, comm_bytes
from jzero.core.comm.quantize import dequantize, quantize
from jzero.core.leaf_layout import leaf_layout
from jzero.core.options.communication import Quant

N = 8
FP8 = jzero.Communication(gather_quant="fp8")
BLOCK = FP8.quant_block  # 256, the default
SUBNORMAL = 2.0**-6  # e4m3's smallest normal: |x| / scale below it is subnormal


def _roundtrip(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x dequantized, each element's scale, the fp8 values ``[blocks, size]``)."""
    q, scale = quantize(x, block=block, dtype="fp8")
    per = jnp.broadcast_to(scale[:, None], q.shape).reshape(-1)[: x.size]
    return dequantize(q, scale, size=x.size, dtype=x.dtype), per, q


def _half_spacing(y: np.ndarray) -> np.ndarray:
    """Half e4m3's spacing at ``|y|``: 2 ** (max(floor(log2 |y|), -6) - 4) (3 mantissa bits;
    subnormals below 2 ** -6, spaced 2 ** -9)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(y), SUBNORMAL))) - 4)


def _wide_values() -> np.ndarray:
    """N(0, 1) values times 2 ** U(-22, 0): blocks of 256 spanning e4m3's normal and
    subnormal ranges, below which values flush to zero."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (1 << 16,)) * jnp.exp2(jax.random.uniform(k2, (1 << 16,)) * -22)
    return np.asarray(x, np.float32)


def test_roundtrip_error_is_at_most_half_an_e4m3_step():
    x = _wide_values()
    x_hat, scale, q = map(np.asarray, _roundtrip(jnp.asarray(x), BLOCK))
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (x.size // BLOCK, BLOCK)
    absmax = np.abs(x).reshape(-1, BLOCK).max(axis=1)
    np.testing.assert_allclose(scale.reshape(-1, BLOCK)[:, 0], absmax / 448, rtol=2**-22)
    # each block's absmax lands on e4m3's largest finite value
    np.testing.assert_array_equal(np.abs(q.astype(np.float32)).max(axis=1), 448)

    x64, err = x.astype(np.float64), np.abs(x.astype(np.float64) - x_hat)
    y = x64 / scale  # |x| / scale, exact in float64
    # fp32's rounding of x / scale and of q * scale: at most 2 ** -23 of |x| and |x̂| each
    fp32 = 2.0**-23 * (np.abs(x64) + np.abs(x_hat))
    bound = _half_spacing(y) * scale
    assert np.all(err <= bound + fp32)
    loose = np.maximum(np.abs(x64) / 16, scale * 2.0**-10)  # the docstrings' form
    assert np.all(err <= loose + fp32)
    # both ranges are exercised, and in each the bound is reached
    normal = np.abs(y) >= SUBNORMAL
    assert 1000 < normal.sum() < x.size - 1000
    for where in (normal, ~normal):
        assert (err[where] / bound[where]).max() > 0.99
    print(f"fp8: max error / bound: normal {(err / bound)[normal].max():.4f}, "
          f"subnormal {(err / bound)[~normal].max():.4f}")  # fmt: skip


def test_zeros_stay_exact_and_non_finite_blocks_stay_non_finite():
    x = jnp.zeros(1024).at[:250].set(jax.random.normal(jax.random.key(1), (250,)))
    q, scale = quantize(x, block=BLOCK, dtype="fp8")
    assert q.shape == (4, 256) and scale.dtype == jnp.float32
    assert bool(jnp.all(q[1:].astype(jnp.float32) == 0)) and bool(jnp.all(scale[1:] == 0))
    for bad in (jnp.inf, jnp.nan):
        x_hat = _roundtrip(x.at[3].set(bad), BLOCK)[0]
        assert not bool(jnp.any(jnp.isfinite(x_hat[:256])))  # the whole block
        assert bool(jnp.all(x_hat[256:] == 0))  # other blocks untouched
    with pytest.raises(ValueError, match="fp8 values are rounded to nearest only"):
        quantize(x, block=BLOCK, dtype="fp8", salt=jnp.uint32(0))


def _rel_l2(x: np.ndarray, dtype: str, block: int | None, *, bulk: bool = False) -> float:
    """Relative L2 error of ``x`` gathered from 8 shards, each quantized on its own in
    blocks of ``block`` (None: one scale per shard); ``bulk``: over the elements up to
    the 99.9th percentile of |x|, i.e. of all but the outliers."""
    shards = x.reshape(N, -1)
    size = shards.shape[1] if block is None else block
    q, scale = quantize(jnp.asarray(shards), block=size, dtype=dtype)
    err = np.asarray(dequantize(q, scale, size=shards.shape[1], dtype=jnp.float32)) - shards
    keep = np.abs(shards) <= np.quantile(np.abs(shards), 0.999) if bulk else True
    return float(np.linalg.norm(np.where(keep, err, 0)) / np.linalg.norm(np.where(keep, shards, 0)))


def test_per_block_scales_against_one_per_tensor_and_fp8_against_int8():
    """The figures behind the default (quantize.py's docstring): blocks of 256 err no more
    than one scale per shard; fp8 errs more than int8 on N(0, 1) and less where a few
    outliers share a block with many small values."""
    rng = np.random.default_rng(0)
    n = 1 << 20
    normal = rng.standard_normal(n).astype(np.float32)
    heavy = rng.standard_t(3, n).astype(np.float32)
    table = {}
    for name, x in (("N(0, 1)", normal), ("Student-t(3)", heavy)):
        table[name] = [_rel_l2(x, "fp8", b) for b in (BLOCK, None)]
        assert table[name][0] <= table[name][1]
    assert 0.025 < table["N(0, 1)"][0] < 0.027  # the documented 2.6e-2
    assert _rel_l2(normal, "int8", BLOCK) < 0.008 < table["N(0, 1)"][0]
    for factor in (100, 1000):  # one element in 10^4 `factor` times larger
        x = np.where(rng.random(n) < 1e-4, factor, 1).astype(np.float32) * normal
        fp8, int8 = (_rel_l2(x, d, BLOCK, bulk=True) for d in ("fp8", "int8"))
        assert fp8 < 0.027 < int8
        table[f"outliers x{factor}, bulk: fp8, int8"] = [fp8, int8]
    for name, (a, b) in table.items():
        print(f"{name}: {a:.3e}, {b:.3e}")  # blocks of 256, one scale per shard


def test_fp8_all_gather_sends_each_shard_roundtripped():
    """Each leaf equals the exact gather of every device's round-tripped shard, alone or
    in a bucket (blocks never straddle two leaves); the values travel as u8 bytes."""
    lays = [leaf_layout(s, N, min_shard_size=0) for s in SHAPES]
    assert check_gathers(lays, Quant("fp8", 64), _roundtrip) == {"u8", "f32"}


def _step(param_dtype, gather_quant):
    precision = jzero.Precision(param_dtype=param_dtype, reduce_dtype=jnp.float32)
    comm = jzero.Communication(gather_quant=gather_quant)
    opt = jzero.ZeroOptimizer(
        optax.sgd(1e-2), jzero.data_mesh(), stage=3, precision=precision, comm=comm
    )
    return opt.train_step(stacked_loss), opt.init(stacked_params())


@functools.cache
def _collectives(param_dtype, gather_quant) -> list:
    step, state = _step(param_dtype, gather_quant)
    return collectives(step.lower(state, stacked_batch()).compile().as_text())


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_gathers_send_a_quarter_of_fp32_plus_scales(param_dtype):
    """One byte per element (0.25x fp32, 0.5x bf16: XLA:CPU runs bf16 gathers in f32, so
    the bf16 volume is counted at 2 bytes, what a GPU sends) and one fp32 scale per block
    of 256 of each gathered shard: int8's collectives with s8 -> u8."""
    width = jnp.dtype(param_dtype).itemsize
    plain, fp8 = _collectives(param_dtype, None), _collectives(param_dtype, "fp8")
    gathers = lambda cs, dtype: [c for c in cs if c.kind == "all-gather" and c.dtype == dtype]
    volume = {}  # bytes per gathered shape (a layer's 64 x 64 kernel, its 64 bias), all passes
    for c in gathers(plain, "f32"):  # f32 on CPU; counted at the parameters' width
        sent = c.result_bytes / 4 * width * (N - 1) / N * c.trip_count
        volume[c.shape] = volume.get(c.shape, 0) + sent
    payload = sum(c.ring_bytes * c.trip_count for c in gathers(fp8, "u8"))
    assert payload == sum(volume.values()) / width  # 1 byte per element
    # one scale per block: a [N, S] payload comes with an [N, ceil(S / 256)] f32 gather
    blocks = sorted((c.shape[0], -(-c.shape[1] // BLOCK), c.trip_count) for c in gathers(fp8, "u8"))
    assert sorted((*c.shape, c.trip_count) for c in gathers(fp8, "f32")) == blocks
    # the 64 x 64 kernel's shard (512 elements, 2 blocks): 0.25 + 1/256 of fp32's bytes
    kernel = sum(c.ring_bytes * c.trip_count for c in fp8 if c.shape in ((N, 512), (N, 2)))
    assert kernel / volume[(64, 64)] == pytest.approx((0.25 + 1 / 256) * 4 / width, rel=1e-12)
    # the same collectives as int8 (s8 -> u8); the reduce-scatters as unquantized
    wire = lambda cs: sorted(
        (c.kind, "u8" if c.dtype == "s8" else c.dtype, c.shape, c.group_size, c.trip_count)
        for c in cs
    )
    assert wire(fp8) == wire(_collectives(param_dtype, "int8"))
    assert [c for c in wire(fp8) if c[0] != "all-gather"] == [
        c for c in wire(plain) if c[0] != "all-gather"
    ]
    ratio = comm_bytes(fp8)["all-gather"] / sum(volume.values())
    print(f"fp8 gathers of {jnp.dtype(param_dtype).name} parameters: {ratio:.4f}x the bytes")


_remat_block = jzero.remat_layer(lambda p, x_BxD: jnp.tanh(x_BxD @ p["w"] + p["b"]))


def remat_loss(params, batch):
    """stacked_loss with each scanned layer a ``jzero.remat_layer`` (manual gathering)."""
    x_BxD, _ = jax.lax.scan(lambda x, p: (_remat_block(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


# (init, loss, batch, step options): stage 3's default per-layer gathering, bucketed,
# prefetched, a manual whole-leaf jzero.gather of awkward (padded) leaves, and remat_layer.
PATHS = {
    "default": (stacked_params, stacked_loss, stacked_batch, {}),
    "bucket": (stacked_params, stacked_loss, stacked_batch, {"comm": {"bucket": True}}),
    "prefetch": (stacked_params, stacked_loss, stacked_batch, {"comm": {"prefetch": True}}),
    "manual": (
        awkward_params,
        awkward_loss,
        lambda: awkward_batches(1)[0],
        {"manual_gather": True},
    ),
    "remat_layer": (stacked_params, remat_loss, stacked_batch, {"manual_gather": True}),
}
STEPS, LR = 4, 0.5


def _fp8_bound(params: dict) -> dict:
    """The documented per-element bound max(|w| / 16, absmax / 458752), with the leaf's
    absmax (>= any of its blocks')."""
    bound = lambda w: np.maximum(np.abs(w) / 16, np.abs(w).max() / 458752) * (1 + 2**-16)
    return jax.tree.map(lambda w: bound(np.asarray(w, np.float64)), params)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_steps_at_the_dequantized_params_within_the_bound(path):
    """Each of STEPS sgd steps takes its gradient at the dequantized parameters ŵ
    (straight-through: new params = w - lr * grad L(ŵ)); each ŵ is within the per-element
    bound of w, so each step's loss L(ŵ) is within the first-order bound
    sum |grad L(w)| * bound of the exact loss L(w); and the run trains."""
    init, loss_fn, batch_fn, options = PATHS[path]
    options = dict(options)
    comm = dataclasses.replace(FP8, **options.pop("comm", {}))
    opt = jzero.ZeroOptimizer(
        optax.sgd(LR), jzero.data_mesh(), stage=3, comm=comm, min_shard_size=1
    )
    step = opt.train_step(loss_fn, donate=False, **options)
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # one device, the whole batch
    state, batch = opt.init(init()), batch_fn()
    per_layer = lambda _: init is stacked_params
    first, worst = None, 0.0
    for _ in range(STEPS):
        params = opt.full_params(state)
        w_hat = dequantized(state, FP8.gather_quantizer, per_layer=per_layer)
        state, metrics = step(state, batch)

        loss_hat, grads_hat = value_and_grad(w_hat, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss_hat), rtol=1e-6)
        want = jax.tree.map(lambda w, g: w - LR * g, params, grads_hat)
        _models.assert_tree_close(opt.full_params(state), want, rtol=1e-5, atol=1e-6)

        loss, moved, first_order = _within_first_order(
            params, w_hat, loss_hat, batch, value_and_grad
        )
        first, worst = float(loss) if first is None else first, max(worst, moved / first_order)
    last = float(value_and_grad(opt.full_params(state), batch)[0])
    print(f"{path}: exact loss {first:.4f} -> {last:.4f} after {STEPS} fp8-gathered steps; "
          f"each |L(ŵ) - L(w)| <= {worst:.3f} x its first-order bound")  # fmt: skip
    assert last < 0.9 * first  # a margin far beyond the per-step bounds (printed above)


def _within_first_order(params, w_hat, loss_hat, batch, value_and_grad) -> tuple:
    """Checks each dequantized element of ``w_hat`` is within :func:`_fp8_bound` of
    ``params`` and ``loss_hat`` (the loss at ``w_hat``) moved from the exact loss by at
    most the first-order bound; ``(exact loss, |moved|, that bound)``."""
    bound = _fp8_bound(params)
    error = jax.tree.map(lambda h, w: np.abs(np.asarray(h, np.float64) - w), w_hat, params)
    assert all(np.all(e <= b) for e, b in zip(*map(jax.tree.leaves, (error, bound))))
    loss, grads = value_and_grad(params, batch)
    moved, first_order = abs(float(loss_hat) - float(loss)), abs_dot(grads, bound)
    assert 0 < moved <= first_order
    return loss, moved, first_order


@ON_THE_EXACT_RUN
@pytest.mark.parametrize("at", SNAPSHOTS)
def test_lm_step_from_the_exact_trajectory_is_taken_at_the_dequantized_params(at):
    """From the exact AdamW run's state after ``at`` steps, one fp8-gathered step of the
    example LM (sgd(1.0): its update is the gradient) computes the loss and gradient at the
    dequantized parameters ŵ, each element within max(|w| / 16, absmax / 458752) of the
    exact w; so its loss is within the first-order bound of the exact L(w)."""
    params, batch = exact_snapshot(at)
    opt, step = sgd_step(FP8)
    state = opt.init(params)
    w_hat = dequantized(state, FP8.gather_quantizer, per_layer=lambda p: "blocks" in p)
    state, metrics = step(state, batch)

    loss_hat, grads_hat = lm_value_and_grad(w_hat, batch)  # one device, the whole batch
    np.testing.assert_allclose(float(metrics["loss"]), float(loss_hat), rtol=1e-6)
    want = jax.tree.map(lambda w, g: w - g, params, grads_hat)  # sgd(1.0)
    _models.assert_tree_close(opt.full_params(state), want, rtol=1e-5, atol=1e-6)

    loss, moved, first_order = _within_first_order(
        params, w_hat, loss_hat, batch, lm_value_and_grad
    )
    print(f"after {at} steps: loss {float(loss):.4f}, fp8-gathered {float(loss_hat):.4f}; "
          f"|difference| {moved:.2e} <= first-order bound {first_order:.2e}")  # fmt: skip


@pytest.mark.parametrize(
    "value", ["fp4", "e4m3", "float8_e4m3fn", jnp.float8_e4m3fn, np.dtype("int8")]
)
def test_bad_gather_quant_is_refused(value):
    with pytest.raises(
        ValueError, match="Communication.gather_quant must be None, 'int8' or 'fp8'"
    ):
        jzero.Communication(gather_quant=value)


def test_fp8_gathers_below_stage_3_are_refused():
    with pytest.raises(ValueError, match="stage 2 gathers no parameters; use stage=3"):
        jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=2, comm=FP8)


@pytest.mark.slow
@pytest.mark.extended  # CI's time; its per-step bounds from the exact run are in CI
def test_example_lm_trains_with_fp8_gathers():
    """200 steps with fp8 gathers end below 0.7 x the first loss (tests/_lm.py: TRAINED):
    a margin of many seed-to-seed deviations, unlike the unigram entropy (finals reach 3.01
    against its 3.12)."""
    losses = lm_losses(FP8)
    assert final(losses) < TRAINED * losses[0]
    print(f"example LM, fp8 gathers, {LM_STEPS} steps: final loss {final(losses):.4f}")
