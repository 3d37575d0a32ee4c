"""Quantized gradient reduce-scatters (``Communication(grad_quant='int8' | 'int4')``, ZeRO++'s qgZ).

Each device's part of a gradient round-trips within one quantization step (absmax/127 of
its block for int8, absmax/7 for int4), rounded stochastically, so without bias; on the
wire the reduce-scatter becomes an s8 (or u8: two int4 values a byte) all-to-all plus
f32 scales of <= 0.3x (int8) / 0.15x (int4) the fp32 volume; the owner's sum is the fp32
sum of the round-tripped parts, so a step's update stays within the summed per-device
bound of the exact one, at every stage and gathering path, and on the example LM from
states along its exact AdamW run; a quantized 200-step run of it still trains; bad
settings are refused with the fix. No test compares the end of a quantized run with the
end of an exact one: those trajectories are chaotic (tests/_lm.py, scripts/accuracy.py).
"""

from __future__ import annotations

import functools
import math

import _lm
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _lm import ON_THE_EXACT_RUN, SNAPSHOTS
from _models import stacked_batch, stacked_loss, stacked_params
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import collectives
from jzero.core.comm.quantize import (
    Quant,
    dequantize,
    pack_int4,
    quantize,
    quantized_reduce_scatter,
    unpack_int4,
)
from jzero.core.leaf_layout import leaf_layout
from jzero.core.mesh import DATA

N = 8
LEVELS = {"int8": 127, "int4": 7}
# documented: about 7e-3 / 0.13 rounded to nearest, 1e-2 / 0.18 stochastically, on N(0, 1)
REL_L2 = {"int8": 1e-2, "int4": 0.15}


def _roundtrip(rows: jax.Array, quant: Quant) -> jax.Array:
    """Each row's blocks quantized and dequantized (what its owner receives)."""
    salt = jax.lax.axis_index(DATA)
    q, scale = quantize(rows, block=quant.block, dtype=quant.dtype, salt=salt)
    return dequantize(q, scale, size=rows.shape[-1], dtype=jnp.float32)


def test_int4_packs_two_values_a_byte():
    q = jax.random.randint(jax.random.key(0), (3, 5, 64), -7, 8, jnp.int8)
    packed = pack_int4(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 32)
    np.testing.assert_array_equal(unpack_int4(packed), q)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_roundtrip_error_is_within_a_step(dtype, rounding):
    x = jax.random.normal(jax.random.key(0), (4, 1 << 14), jnp.float32)
    salt = None if rounding == "nearest" else jnp.uint32(3)
    q, scale = quantize(x, block=256, dtype=dtype, salt=salt)
    assert q.shape == (4, 64, 256) and scale.shape == (4, 64)
    assert int(jnp.max(jnp.abs(q))) == LEVELS[dtype]
    x_hat = dequantize(q, scale, size=x.shape[-1], dtype=jnp.float32)
    step = jnp.repeat(scale, 256, axis=-1) * (0.5 if salt is None else 1.0)
    assert bool(jnp.all(jnp.abs(x - x_hat) <= step * (1 + 1e-6) + 1e-7))
    rel_l2 = float(jnp.linalg.norm(x - x_hat) / jnp.linalg.norm(x))
    assert 0 < rel_l2 < REL_L2[dtype] * (1 if salt is None else 1.5)
    print(f"{dtype} block 256, {rounding}: relative L2 error {rel_l2:.2e} on N(0, 1)")
    # int4 blocks hold an even number of elements (two a byte)
    assert quantize(jnp.ones(9), block=3, dtype="int4")[0].shape == (3, 4)


SHAPES = [(16, 24), (24,), (5, 3), (7,), (4, 9, 16), (3, 300)]  # padded, dims 0/1/2, >1 block


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_owner_sums_every_devices_roundtripped_part(dtype):
    """Alone or bucketed, each shard is the exact reduce-scatter of every device's
    round-tripped gradient (each leaf's rows blocked on their own)."""
    lays = [leaf_layout(s, N, min_shard_size=0) for s in SHAPES]
    assert {lay.dim for lay in lays} >= {0, 1} and any(lay.pad for lay in lays)
    keys = jax.random.split(jax.random.key(1), len(lays))
    grads = [jax.random.normal(k, (N, *lay.shape)) for k, lay in zip(keys, lays)]
    quant = Quant(dtype, 32)

    def body(grads):
        grads = [g[0] for g in grads]  # this device's own full gradient
        exact = []
        for g, lay in zip(grads, lays):
            a = lay.axis(g)
            padded = jnp.pad(g, [(0, lay.pad if i == a else 0) for i in range(g.ndim)])
            moved = jnp.moveaxis(padded, a, 0)
            rows = _roundtrip(moved.reshape(N, -1), quant).reshape(moved.shape)
            rows = jnp.moveaxis(rows, 0, a)
            exact.append(jax.lax.psum_scatter(rows, DATA, scatter_dimension=a, tiled=True))
        alone = [
            quantized_reduce_scatter([g], [lay], quant=quant)[0] for g, lay in zip(grads, lays)
        ]
        return exact, alone, quantized_reduce_scatter(grads, lays, quant=quant)

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=jzero.data_mesh(),
            in_specs=([P(DATA)] * len(lays),),
            out_specs=([lay.data_spec() for lay in lays],) * 3,
            check_vma=False,
        )
    )
    for exact, alone, bucketed, lay in zip(*run(grads), lays):
        assert alone.shape == lay.padded  # every device's shard, assembled
        np.testing.assert_allclose(alone, exact, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(bucketed, exact, rtol=1e-6, atol=1e-6)
    colls = collectives(run.lower(grads).compile().as_text())
    wire = "s8" if dtype == "int8" else "u8"
    assert {c.dtype for c in colls if c.kind == "all-to-all"} == {wire, "f32"}


def test_stochastic_rounding_is_unbiased():
    """Values far below their block's absmax: rounded to nearest they all vanish; rounded
    stochastically their mean survives (to within a few standard errors)."""
    x = jnp.full((1 << 16,), 0.2).at[::256].set(127.0)  # step 1.0 per block
    small = jnp.arange(x.size) % 256 != 0
    for salt, want in ((None, 0.0), (jnp.uint32(5), 0.2)):
        q, scale = quantize(x, block=256, salt=salt)
        x_hat = dequantize(q, scale, size=x.size, dtype=jnp.float32)
        mean = float(jnp.mean(x_hat[small]))
        assert abs(mean - want) < 4 * 0.4 / math.sqrt(int(small.sum())), (salt, mean)


def test_non_finite_gradients_stay_non_finite():
    """A step with an inf or NaN in its gradients must look non-finite after the
    quantized reduce-scatter too (dynamic loss scaling then skips it)."""
    lay = leaf_layout((N * 64,), N, min_shard_size=0)  # device j owns [64 j, 64 j + 64)
    grads = jnp.zeros((N, N * 64)).at[3, 5 * 64 + 7].set(jnp.inf).at[4, 2 * 64 + 1].set(jnp.nan)

    def body(g):
        return quantized_reduce_scatter([g[0]], [lay], quant=Quant("int8", 16))[0]

    run = jax.shard_map(
        body, mesh=jzero.data_mesh(), in_specs=(P(DATA),), out_specs=P(DATA), check_vma=False
    )
    out = np.asarray(jax.jit(run)(grads)).reshape(N, 64)
    finite = np.isfinite(out).all(axis=1)
    assert not finite[5] and not finite[2] and finite[[0, 1, 3, 4, 6, 7]].all()


# (stage, step options): every place a gradient is reduce-scattered
PATHS = {
    "stage1": (1, {}),
    "stage2": (2, {}),
    "stage3": (3, {}),
    "stage3-bucket": (3, {"bucket": True}),  # Communication fields
    "stage3-prefetch": (3, {"prefetch": True}),
    "stage3-hsdp": (3, {}),  # 2 replicas x 4: quantized within 'data', exact across
}


def _per_device_grads(params: dict, batch: dict) -> list:
    """Each device's gradient of its own slice of the batch, on one device."""
    per = jax.tree.leaves(batch)[0].shape[0] // N
    slices = [jax.tree.map(lambda x, d=d: x[d * per : (d + 1) * per], batch) for d in range(N)]
    return [jax.jit(jax.grad(stacked_loss))(params, b) for b in slices]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_update_is_within_the_summed_per_device_bound(path, dtype):
    """sgd(1.0): the update is the reduced gradient. Each device's part (1/N of its
    gradient) is off by less than one step, absmax/levels of its block, so the sum by at
    most the sum over devices of that, bounded here by each device's absmax over the whole
    leaf."""
    stage, options = PATHS[path]
    mesh = jzero.hybrid_mesh(2) if path.endswith("hsdp") else jzero.data_mesh()
    comm = jzero.Communication(grad_quant=dtype, **options)
    opt = jzero.ZeroOptimizer(optax.sgd(1.0), mesh, stage=stage, comm=comm, min_shard_size=1)
    state, batch = opt.init(stacked_params()), stacked_batch()
    params = opt.full_params(state)
    state, _ = opt.train_step(stacked_loss)(state, batch)
    got = jax.tree.map(lambda w, w1: w - w1, params, opt.full_params(state))

    per_device = _per_device_grads(params, batch)
    exact = jax.tree.map(lambda *g: sum(g) / N, *per_device)
    absmax = jax.tree.map(lambda *g: sum(jnp.max(jnp.abs(x)) / N for x in g), *per_device)
    for g, want, a in zip(*map(jax.tree.leaves, (got, exact, absmax))):
        bound = a / LEVELS[dtype] * (1 + 1e-4) + 1e-6  # + fp32 rounding of w - g
        assert float(jnp.max(jnp.abs(g - want))) <= float(bound)
    rel_l2 = [float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) for g, w in
              zip(jax.tree.leaves(got), jax.tree.leaves(exact))]  # fmt: skip
    assert 1e-4 < max(rel_l2) < 3 * REL_L2[dtype]  # really quantized, and about as documented


@functools.cache
def _stage3(grad_quant: str | None):
    opt = jzero.ZeroOptimizer(
        optax.sgd(1e-2),
        jzero.data_mesh(),
        stage=3,
        comm=jzero.Communication(grad_quant=grad_quant),
        min_shard_size=1,
    )
    return opt.train_step(stacked_loss), opt.init(stacked_params())


@pytest.mark.parametrize(("dtype", "ratio"), [("int8", 0.3), ("int4", 0.15)])
def test_quantized_reduce_scatters_send_a_fraction_of_fp32(dtype, ratio):
    step, state = _stage3(None)
    plain = collectives(step.lower(state, stacked_batch()).compile().as_text())
    volume = sum(c.ring_bytes * c.trip_count for c in plain if c.kind == "reduce-scatter")
    step, state = _stage3(dtype)
    report = jzero.report(step, state, stacked_batch())
    colls = list(report.collectives)
    assert not [c for c in colls if c.kind == "reduce-scatter"]  # all became all-to-alls
    wire = {"int8": "s8", "int4": "u8"}[dtype]
    sent = [c for c in colls if c.kind == "all-to-all"]
    assert {c.dtype for c in sent} == {wire, "f32"}  # values, and fp32 scales
    payload = sum(c.ring_bytes * c.trip_count for c in sent if c.dtype == wire)
    assert payload == volume / 4 / (1 if dtype == "int8" else 2)  # 1 or 1/2 byte an element
    assert sum(c.ring_bytes * c.trip_count for c in sent) <= ratio * volume
    # forward's all-gathers are untouched
    gathers = lambda cs: sorted(
        (c.dtype, c.shape, c.trip_count) for c in cs if c.kind == "all-gather"
    )
    assert gathers(colls) == gathers(plain)
    assert "quantized gradient reduce-scatters" in str(report)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_quant": "int2"}, "Communication.grad_quant must be None or 'int8' or 'int4', got"),
        ({"grad_quant": jnp.int8}, "Communication.grad_quant must be None or 'int8' or 'int4'"),
        ({"grad_quant": "int4", "quant_block": 255}, "must be even with grad_quant='int4'"),
        ({"grad_quant": "int8", "quant_block": 0}, "Communication.quant_block must be a positive"),
    ],
)
def test_bad_gradient_quantization_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jzero.Communication(**kwargs)


def test_quantized_gradients_at_stage_0_are_refused():
    comm = jzero.Communication(grad_quant="int8")
    with pytest.raises(ValueError, match="stage 0 all-reduces its gradients; use stage=1, 2"):
        jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=0, comm=comm)


def _lm_per_device_grads(params: dict, batch: dict) -> tuple[float, list]:
    """The example LM's loss on the whole batch, and each device's gradient of its own
    slice of the batch, on one device."""
    per = _lm.BATCH // N
    slices = [{"tokens": batch["tokens"][d * per : (d + 1) * per]} for d in range(N)]
    grads = [_lm.value_and_grad(params, b)[1] for b in slices]
    return float(_lm.value_and_grad(params, batch)[0]), grads


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@ON_THE_EXACT_RUN
@pytest.mark.parametrize("at", SNAPSHOTS)
def test_lm_step_from_the_exact_trajectory_is_within_the_summed_bound(at, dtype):
    """From the exact AdamW run's state after ``at`` steps, one step of the example LM with
    quantized gradient reduce-scatters (sgd(1.0): its update is the reduced gradient) is
    within the summed per-device bound of the exact gradient, and its loss (forward is
    exact) is the exact loss. One step from one state: it holds on any CPU."""
    params, batch = _lm.exact_snapshot(at)
    opt, step = _lm.sgd_step(jzero.Communication(grad_quant=dtype))
    state, metrics = step(opt.init(params), batch)
    got = jax.tree.map(lambda w, w1: w - np.asarray(w1), params, opt.full_params(state))

    loss, per_device = _lm_per_device_grads(params, batch)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-6)
    exact = jax.tree.map(lambda *g: sum(g) / N, *per_device)
    absmax = jax.tree.map(lambda *g: sum(jnp.max(jnp.abs(x)) / N for x in g), *per_device)
    worst = 0.0
    for g, want, a in zip(*map(jax.tree.leaves, (got, exact, absmax))):
        bound = a / LEVELS[dtype] * (1 + 1e-4) + 1e-6  # + fp32 rounding of w - g
        err = float(jnp.max(jnp.abs(g - want)))
        assert err <= float(bound)
        worst = max(worst, err / float(bound))
    rel_l2 = [float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) for g, w in
              zip(jax.tree.leaves(got), jax.tree.leaves(exact))]  # fmt: skip
    assert max(rel_l2) > 1e-4  # really quantized
    print(f"after {at} steps, {dtype}: largest error / bound {worst:.2f}, "
          f"relative L2 error up to {max(rel_l2):.1e}")  # fmt: skip


@pytest.mark.slow
# int8 only (CI's time): int4's steps are held to their bound from the exact trajectory
# above, step by step, which is the stronger check.
@pytest.mark.parametrize("dtype", ["int8"])
def test_example_lm_trains_with_quantized_gradients(dtype):
    """200 steps with quantized gradients end below 0.7 x the first loss (tests/_lm.py:
    TRAINED)."""
    losses = _lm.lm_losses(jzero.Communication(grad_quant=dtype))
    final = _lm.final(losses)
    assert final < _lm.TRAINED * losses[0]
    print(f"example LM, {dtype} gradients, {_lm.LM_STEPS} steps: final loss {final:.4f}")
