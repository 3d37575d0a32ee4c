"""jzero.accounting.schedule: which collectives of a scheduled HLO module overlap compute.

A hand-written module in the GPU's form (an all-gather start/done pair with a fusion and a
cuBLAS call scheduled between, an async-start wrapping an all-gather with nothing between,
inside a loop of 6 trips) gives exact counts; a stage-3 step compiled for 8 CPU devices
(XLA:CPU's collectives are synchronous) overlaps nothing, and every all-gather
``jzero.accounting.collectives`` counts is reported once.
"""

import jax
import jax.numpy as jnp
import optax

import jzero
from jzero.accounting import collectives
from jzero.accounting.schedule import Overlap, collective_overlap, overlap_summary

GPU_MODULE = """HloModule m, is_scheduled=true, num_partitions=8

%wrapped (p: f32[4]) -> f32[32] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[32]{0} all-gather(%p), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
}

%body (c: (s32[], f32[4])) -> (s32[], f32[4]) {
  %c = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%c), index=1
  %s = (f32[4]{0}, f32[32]{0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %g = f32[4]{0} custom-call(%f), custom_call_target="__cublas$gemm"
  %d = f32[32]{0} all-gather-done(%s)
  %s2 = ((f32[4]{0}), f32[32]{0}) async-start(%x), calls=%wrapped
  %d2 = f32[32]{0} async-done(%s2)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %g)
}

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %ar = f32[4]{0} all-reduce(%a), channel_id=3, replica_groups={}, to_apply=%cond
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %ar)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, TRIPS
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
""".replace("TRIPS", 'backend_config={"known_trip_count":{"n":"6"}}')


def test_compute_between_start_and_done_is_counted_per_pair():
    assert collective_overlap(GPU_MODULE) == [
        Overlap("all-gather", "d", "body", True, 2, 6),  # a fusion and a cuBLAS call
        Overlap("all-gather", "d2", "body", True, 0, 6),  # wrapped: reported at the pair
        Overlap("all-reduce", "ar", "main", False, 0, 1),
    ]
    assert overlap_summary(collective_overlap(GPU_MODULE)) == {
        "kind": "all-gather",
        "runs": 12,
        "asynchronous": 12,
        "overlapped": 6,
        "overlapped_fraction": 0.5,
        "instructions": 2,
    }
    assert overlap_summary([], kind="all-gather")["overlapped_fraction"] is None


def test_cpu_stage3_step_gathers_synchronously_and_every_gather_is_read():
    def loss(p, batch):
        h, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), batch["x"], p["w"])
        return jnp.mean(h**2)

    comm = jzero.Communication(prefetch=True)
    opt = jzero.ZeroOptimizer(optax.adam(1e-3), jzero.data_mesh(), stage=3, comm=comm)
    params = {"w": jnp.ones((3, 16, 16)) / 16}
    state = opt.init(params)
    batch = {"x": jnp.ones((8, 16))}
    text = opt.train_step(loss).lower(state, batch).compile().as_text()
    found = collective_overlap(text)
    gathers = [c for c in collectives(text) if c.kind == "all-gather"]
    summary = overlap_summary(found)
    assert summary["runs"] == sum({(c.computation, c.name): c.trip_count for c in gathers}.values())
    assert summary["runs"] >= 2 * 3  # forward and backward, each layer
    assert summary["asynchronous"] == summary["overlapped"] == 0
    assert summary["overlapped_fraction"] == 0.0
