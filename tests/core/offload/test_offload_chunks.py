"""Chunked streaming of an offloaded elementwise update (``offload_chunk``), on 8 CPU devices.

The stacked model (``_models.stacked_params``) holds every layer in one kernel leaf
``[layers, width, width]``, sharded along its second axis. With ``offload_chunk`` one
layer's kernel, an elementwise update (Adam, clip + AdamW) streams that leaf in one chunk
per layer along the layer axis; Adafactor's is not elementwise and streams whole leaves.
XLA:CPU has one memory, so memory is not asserted: placement, numerics against the run
without offload, and the chunks themselves (in the jaxpr, in the compiled collectives).
"""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import regression_batches, stacked_batch, stacked_loss, stacked_params
from _offload import (
    BF16,
    FP16,
    HOST,
    TXS,
    assert_overflow_skipped_as_without_offload,
    full_parts,
    memory_kinds,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jzero
from jzero.accounting import collectives
from jzero.core.offload.chunks import cuts, elementwise
from jzero.core.offload.split import split_update
from jzero.core.options.offload import DEFAULT_OFFLOAD_CHUNK

KERNEL = stacked_params()["layers"]["w"].shape  # (layers, width, width)
LAYER = KERNEL[1] * KERNEL[2]  # elements of one layer's kernel: the chunk size here
STEPS = 5


def _opt(tx, *, stage: int, chunk: int | None, offload: str | None = "optimizer", **kw):
    extra = {} if offload is None else {"offload": jzero.Offload(optimizer="stream", chunk=chunk)}
    return jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage, min_shard_size=1, **extra, **kw)


@functools.cache
def _run(stage: int, tx: str, offload: str | None, chunk: int | None = LAYER):
    """``STEPS`` steps of the stacked model in bf16; the optimizer, step, last state, losses."""
    opt = _opt(TXS[tx], stage=stage, chunk=chunk, offload=offload, precision=BF16)
    state, step = opt.init(stacked_params()), opt.train_step(stacked_loss)
    losses = []
    for batch in regression_batches(STEPS, 16, KERNEL[1]):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, step, state, losses


@pytest.mark.parametrize("tx", ["adam", "clip_adamw", "adafactor"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_chunked_update_matches_the_device_run(stage, tx):
    opt, _, state, losses = _run(stage, tx, "optimizer")
    assert memory_kinds((state.opt_state, state.master)) == {HOST}
    assert memory_kinds(state.params) == {"device"}
    _, _, plain, plain_losses = _run(stage, tx, None)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        assert got.sharding.spec == want.sharding.spec
        assert got.addressable_data(0).shape == want.addressable_data(0).shape
    if tx == "clip_adamw":
        _assert_each_step_within_a_rounding(stage)
        return
    # Adam, Adafactor: the same equations compiled to the same arithmetic, so the same run
    assert losses == plain_losses
    for got, expected in zip(
        *map(jax.tree.leaves, (full_parts(opt, state), full_parts(opt, plain)))
    ):
        np.testing.assert_array_equal(got, expected)


def _assert_each_step_within_a_rounding(stage: int) -> None:
    """clip + AdamW: the same equations, but XLA:CPU fuses them differently in the chunked
    program: it recomputes the new first moment inside the fusion that computes the update
    direction (the stored moment stays bitwise equal) and contracts a multiply-add there
    into an FMA, so a step's fp32 master weights may differ by a rounding of the update,
    within one ulp of the largest weight, and their bf16 casts (the parameters) by one bf16
    ulp where that rounding crosses a bf16 rounding boundary. Compared one step at a time
    from the same state (the device run's, moved to host memory), at each state of the
    device run: over several steps one such crossing would change every later loss."""
    tx = TXS["clip_adamw"]
    plain = _opt(tx, stage=stage, chunk=None, offload=None, precision=BF16)
    chunked = _opt(tx, stage=stage, chunk=LAYER, precision=BF16)
    plain_step = plain.train_step(stacked_loss, donate=False)
    chunked_step = chunked.train_step(stacked_loss, donate=False)
    host = lambda tree: jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), tree
    )
    state, template = plain.init(stacked_params()), chunked.init(stacked_params())
    for batch in regression_batches(STEPS, 16, KERNEL[1]):
        moved = template.replace(
            step=state.step, params=state.params, opt_state=host(state.opt_state),
            master=host(state.master), loss_scale=state.loss_scale,
        )  # fmt: skip
        got, got_metrics = chunked_step(moved, batch)
        state, metrics = plain_step(state, batch)
        assert float(got_metrics["loss"]) == float(metrics["loss"])  # the same forward
        (params, opt_state, master), want = full_parts(chunked, got), full_parts(plain, state)
        for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(want[1])):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(want[2])):
            ulp = np.spacing(np.abs(b).max())  # fp32
            np.testing.assert_allclose(a, b, rtol=0, atol=ulp)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want[0])):
            b = np.asarray(b, np.float32)
            ulp = np.spacing(np.abs(b).max()) * 2**16  # bf16: 16 fewer mantissa bits
            np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0, atol=ulp)


def _host_ops(step, state, op: str) -> list[tuple[int, ...]]:
    """Shapes of the host-memory results of ``op`` in the traced step."""
    jaxpr = str(jax.make_jaxpr(step)(state, stacked_batch()))
    found = re.findall(rf"f32<host>\[([\d,]*)\] = {op}\b", jaxpr)
    return [tuple(int(s) for s in shape.split(",")) for shape in found]


def test_stacked_kernel_streams_one_chunk_per_layer_along_the_layer_axis():
    opt, step, state, _ = _run(3, "adam", "optimizer")
    plan = state.plan
    kernel = next(i for i, s in enumerate(plan.params) if s.layout.shape == KERNEL)
    split = split_update(TXS["adam"], plan)
    chunks = [cuts(split, b, plan, plan.config.offload.stream_chunk) for b in split.buckets]
    assert [c is not None for c in chunks] == [i == kernel for i in range(len(plan.params))]
    assert chunks[kernel] == tuple((0, layer, 1) for layer in range(KERNEL[0]))
    assert plan.params[kernel].layout.dim != 0  # the shard axis is never cut
    # Per layer, its first moment, second moment and master weights are sliced from host
    # memory and written into their new host leaf: nothing else is sliced there.
    host_leaves = 3 * KERNEL[0]
    assert _host_ops(step, state, "dynamic_slice") == [(1, *KERNEL[1:])] * host_leaves
    assert _host_ops(step, state, "dynamic_update_slice") == [KERNEL] * host_leaves
    # Cutting along an unsharded axis adds no communication: the collectives are those
    # of the same step streaming whole leaves.
    whole = _opt(TXS["adam"], stage=3, chunk=int(np.prod(KERNEL)), precision=BF16)
    batch = stacked_batch()
    compiled = [
        s.lower(x, batch).compile().as_text()
        for s, x in ((step, state), (whole.train_step(stacked_loss), whole.init(stacked_params())))
    ]
    kinds = [
        sorted((c.kind, c.dtype, c.shape, c.trip_count) for c in collectives(hlo))
        for hlo in compiled
    ]
    assert kinds[0] == kinds[1] and kinds[0]


def test_adafactor_and_per_leaf_norms_are_not_chunked():
    # Adafactor's statistics are reduced over the leaf; so is clip_by_block_rms's norm.
    block_rms = optax.chain(optax.scale_by_adam(), optax.clip_by_block_rms(1.0))
    for tx in (TXS["adafactor"], block_rms):
        plan = _opt(tx, stage=2, chunk=1).plan(stacked_params())
        split = split_update(tx, plan)
        assert split.streams  # one bucket per leaf, each streamed whole
        for b in split.buckets:
            shape = plan.params[b.params[0]].layout.shape
            assert not elementwise(split.jaxpr.jaxpr, b.equations, shape)
            assert cuts(split, b, plan, 1) is None
    _, step, state, _ = _run(2, "adafactor", "optimizer")
    assert _host_ops(step, state, "dynamic_slice") == []


def test_cut_axis_avoids_every_sharded_axis():
    # 8 devices on `data`: one layer exceeds the chunk, so the minor axis is cut, never
    # the data-sharded one; every chunk within the bound, together tiling the axis.
    chunk = LAYER // 2
    plan = _opt(TXS["adam"], stage=3, chunk=chunk).plan(stacked_params())
    split = split_update(TXS["adam"], plan)
    kernel = next(b for b in split.buckets if plan.params[b.params[0]].layout.shape == KERNEL)
    pieces = cuts(split, kernel, plan, chunk)
    dim = plan.params[kernel.params[0]].layout.dim
    assert {c.axis for c in pieces} == {len(KERNEL) - 1} and dim != len(KERNEL) - 1
    assert all(np.prod(KERNEL) // KERNEL[-1] * c.size <= chunk for c in pieces)
    assert [c.start for c in pieces] == np.cumsum([0] + [c.size for c in pieces[:-1]]).tolist()
    assert sum(c.size for c in pieces) == KERNEL[-1]
    # A `model` axis on the minor dimension too: only the layer axis is left, and it is
    # cut one layer at a time even though a layer exceeds the chunk.
    devices = np.array(jax.devices()).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"layers": {"w": P(None, None, "model"), "b": P()}}
    offload = jzero.Offload(optimizer="stream", chunk=chunk)
    opt = jzero.ZeroOptimizer(TXS["adam"], mesh, stage=3, param_specs=specs, offload=offload)
    plan = opt.plan(stacked_params())
    split = split_update(TXS["adam"], plan)
    kernel = next(b for b in split.buckets if plan.params[b.params[0]].layout.shape == KERNEL)
    assert plan.params[kernel.params[0]].layout.spec == P(None, "data", "model")
    assert cuts(split, kernel, plan, chunk) == tuple((0, i, 1) for i in range(KERNEL[0]))


def test_fp16_overflow_skips_every_chunk():
    good, bad = regression_batches(2, 16, KERNEL[1])
    bad = {"x": (bad["x"] * 1e5).astype(jnp.float16), "y": bad["y"]}  # overflows fp16
    make_opt = lambda offload: _opt(
        TXS["adam"], stage=2, chunk=LAYER, offload=offload, precision=FP16
    )
    assert_overflow_skipped_as_without_offload(
        make_opt, stacked_params(), stacked_loss, (good, bad, good)
    )


def test_offload_chunk_errors():
    for bad in (0, -4, 2.5, True, "16M"):
        with pytest.raises(ValueError, match="Offload.chunk must be a positive int"):
            _opt(TXS["adam"], stage=1, chunk=bad)
    for optimizer in (None, "host"):
        with pytest.raises(ValueError, match="only optimizer='stream' does"):
            jzero.Offload(optimizer=optimizer, chunk=LAYER)
    with pytest.raises(TypeError, match=r"offload_chunk moved to jzero.Offload \(as chunk\)"):
        jzero.ZeroOptimizer(TXS["adam"], jzero.data_mesh(), stage=1, offload_chunk=LAYER)
    plan = _opt(TXS["adam"], stage=1, chunk=None).plan(stacked_params())
    assert plan.config.offload.stream_chunk == DEFAULT_OFFLOAD_CHUNK
    plan = _opt(TXS["adam"], stage=1, chunk=None, offload=None).plan(stacked_params())
    assert plan.config.offload.stream_chunk is None


def test_estimate_bounds_the_streamed_state_by_the_chunk():
    kw = dict(params=1000, devices=4, stage=2, largest_layer_params=100, offload="optimizer")
    chunked = jzero.estimate(**kw, offload_chunk=10)
    assert chunked.optimizer_bytes == 2 * 12 * 10 / 4  # two chunks' state streaming through
    assert chunked.host_bytes == jzero.estimate(**kw).host_bytes
    default = inspect.signature(jzero.estimate).parameters["offload_chunk"].default
    assert default == DEFAULT_OFFLOAD_CHUNK
    with pytest.raises(ValueError, match="offload_chunk must be an integer >= 1"):
        jzero.estimate(**kw, offload_chunk=0)
