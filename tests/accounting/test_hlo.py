"""Collectives read back from compiled HLO: kinds, groups, trip counts and ring bytes.

Real programs are compiled on the 8 CPU devices set up by conftest.py; the GPU-only
async forms and the replica-group spellings are checked on hand-written HLO text.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from _hlo_text import ALL_REDUCE_MODULE
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.accounting import (
    Collective,
    collectives,
    comm_bytes,
    dot_flops,
    launches,
    summary_table,
)

N = 8


def _mesh_1d():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def _mesh_2d():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _hlo(f, in_specs, out_specs, *args, mesh=None):
    mesh = _mesh_1d() if mesh is None else mesh
    g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(g).lower(*args).compile().as_text()


def _ones(n, dtype=jnp.float32):
    return jnp.ones((n,), dtype)


def _bytes(**kw):
    out = {"all-reduce": 0.0, "reduce-scatter": 0.0, "all-gather": 0.0, "other": 0.0}
    out.update(kw)
    out["total"] = sum(out.values())
    return out


def test_devices():
    assert jax.device_count() == N


def test_psum_f32_1024():
    hlo = _hlo(lambda x: jax.lax.psum(x, "data"), P("data"), P(), _ones(N * 1024))
    (c,) = collectives(hlo)
    assert c.kind == "all-reduce" and c.dtype == "f32" and c.shape == (1024,)
    assert (c.group_size, c.result_bytes, c.operand_bytes, c.trip_count) == (8, 4096, 4096, 1)
    assert c.ring_bytes == 2 * 4096 * 7 / 8 == 7168
    assert comm_bytes(hlo) == _bytes(**{"all-reduce": 7168})
    assert comm_bytes([c]) == comm_bytes(hlo)


def test_psum_scatter():
    f = lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)
    (c,) = collectives(_hlo(f, P(), P("data"), _ones(1024)))
    assert (c.kind, c.shape, c.group_size) == ("reduce-scatter", (128,), 8)
    assert (c.result_bytes, c.operand_bytes) == (512, 4096)
    assert c.ring_bytes == 4096 * 7 / 8 == 3584


def test_all_gather_bf16_runs_in_f32_on_cpu():
    # XLA:CPU converts a bf16 collective to f32 around it: the HLO (and so the count)
    # moves f32 bytes; other backends keep bf16.
    f = lambda x: jax.lax.all_gather(x, "data", axis=0, tiled=True)
    (c,) = collectives(_hlo(f, P("data"), P(), _ones(N * 128, jnp.bfloat16)))
    dtype, size = ("f32", 4) if jax.default_backend() == "cpu" else ("bf16", 2)
    assert (c.kind, c.dtype, c.shape, c.group_size) == ("all-gather", dtype, (1024,), 8)
    assert (c.result_bytes, c.operand_bytes) == (1024 * size, 128 * size)
    assert c.ring_bytes == 1024 * size * 7 / 8


def test_ppermute_and_all_to_all_are_other():
    perm = [(i, (i + 1) % N) for i in range(N)]
    (c,) = collectives(
        _hlo(lambda x: jax.lax.ppermute(x, "data", perm), P("data"), P("data"), _ones(N * 1024))
    )
    assert (c.kind, c.group_size, c.ring_bytes) == ("collective-permute", 8, 4096)

    f = lambda x: jax.lax.all_to_all(x, "data", 0, 0, tiled=True)
    hlo = _hlo(f, P("data"), P("data"), _ones(N * 1024))
    cs = collectives(hlo)  # CPU splits it into an 8-tuple: one entry per element
    assert {c.kind for c in cs} == {"all-to-all"} and len({c.name for c in cs}) == 1
    assert sum(c.operand_bytes for c in cs) == 4096
    assert comm_bytes(hlo) == _bytes(other=4096 * 7 / 8)


def test_scan_multiplies_by_trip_count():
    def f(x):
        def body(c, _):  # the gather depends on the carry, so XLA cannot hoist it
            return c + jax.lax.all_gather(c, "data", axis=0, tiled=True)[:128], None

        return jax.lax.scan(body, x, None, length=5)[0]

    (c,) = collectives(_hlo(f, P("data"), P("data"), _ones(N * 128)))
    assert (c.kind, c.shape, c.trip_count) == ("all-gather", (1024,), 5)
    assert comm_bytes([c]) == _bytes(**{"all-gather": 5 * 4096 * 7 / 8})


def test_nested_scans_and_fori_loop_multiply():
    def nested(x):
        inner = lambda c, _: (c + jax.lax.psum(c * c, "data"), None)
        outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)
        return jax.lax.scan(outer, x, None, length=4)[0]

    (c,) = collectives(_hlo(nested, P("data"), P("data"), _ones(N * 1024)))
    assert (c.kind, c.trip_count) == ("all-reduce", 12)
    assert comm_bytes([c])["total"] == 12 * 7168

    def fori(x):
        return jax.lax.fori_loop(0, 7, lambda i, c: c + jax.lax.psum(c, "data"), x)

    (c,) = collectives(_hlo(fori, P("data"), P("data"), _ones(N * 1024)))
    assert c.trip_count == 7


def test_unknown_trip_count_raises():
    def f(x):
        cond = lambda c: c[0] < 100.0
        return jax.lax.while_loop(cond, lambda c: c + jax.lax.psum(c, "data"), x)

    cs = collectives(_hlo(f, P("data"), P("data"), _ones(N * 1024)))
    assert [c.trip_count for c in cs] == [None]
    with pytest.raises(ValueError, match=re.escape(f"all-reduce %{cs[0].name} in computation")):
        comm_bytes(cs)
    assert "?" in summary_table(cs)


@pytest.mark.parametrize(
    "axes, out_spec, group",
    [("data", P("model"), 4), ("model", P("data"), 2), (("data", "model"), P(), 8)],
)
def test_2d_mesh_group_sizes(axes, out_spec, group):
    f = lambda x: jax.lax.psum(x, axes)
    (c,) = collectives(_hlo(f, P(("data", "model")), out_spec, _ones(N * 1024), mesh=_mesh_2d()))
    assert (c.kind, c.group_size) == ("all-reduce", group)
    assert c.ring_bytes == 2 * 4096 * (group - 1) / group


def test_auto_sharded_iota_and_mesh_groups():
    # XLA's partitioner prints `[2,4]<=[4,2]T(1,0)` and `mesh[...] {'axis_0'}` groups.
    mesh = _mesh_2d()
    w = jax.device_put(jnp.ones((256, 512)), NamedSharding(mesh, P("data", "model")))
    x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("data", None)))
    f = jax.jit(lambda w, x: jnp.tanh(x @ w).sum(0), out_shardings=NamedSharding(mesh, P()))
    cs = collectives(f.lower(w, x).compile().as_text())
    got = sorted((c.kind, c.shape, c.group_size) for c in cs)
    assert got == [
        ("all-gather", (256, 256), 4),
        ("all-gather", (512,), 2),
        ("all-reduce", (256,), 4),
    ]


@pytest.mark.parametrize(
    "groups, size",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
        ("replica_groups={}", 8),
        ("replica_groups=[2,4]<=[8]", 4),
        ("replica_groups=[4,2]<=[4,2]T(1,0)", 2),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", 8),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}", 2),
        ("replica_groups=mesh['a'=4,'b'=2] {'a','b'}", 8),
        ("replica_groups=mesh[a=4,b=2] {b}", 2),
        ("replica_groups=mesh['a'=8] {'a':(2)4}", 4),
        ("replica_groups=mesh['a'=4,'b'=2] {}", 1),
        ("replica_groups=maximal_mesh[device_id=3] {}", 1),
    ],
)
def test_replica_group_forms(groups, size):
    (c,) = collectives(ALL_REDUCE_MODULE.replace("GROUPS", groups))
    assert (c.group_size, c.computation, c.name) == (size, "main", "ar")


def test_empty_groups_use_num_devices_argument():
    (c,) = collectives(ALL_REDUCE_MODULE.replace("GROUPS", "replica_groups={}"), num_devices=4)
    assert c.group_size == 4


# GPU-style module: async start/done pairs (sugared), a generic async-start wrapping a
# reduce-scatter inside a while loop, and a combined (tuple-shaped) all-reduce.
_GPU = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (wp: bf16[1024]) -> bf16[128] {
  %wp = bf16[1024]{0} parameter(0)
  ROOT %rs = bf16[128]{0} reduce-scatter(%wp), channel_id=4, replica_groups=[1,8]<=[8], \
dimensions={0}, to_apply=%add
}

%body (bp: (s32[], bf16[1024])) -> (s32[], bf16[1024]) {
  %bp = (s32[], bf16[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = bf16[1024]{0} get-tuple-element(%bp), index=1
  %rs-start = ((bf16[1024]{0}), bf16[128]{0}, s32[]) async-start(%v), \
calls=%wrapped_reduce_scatter, backend_config={"operation_queue_id":"0"}
  %rs-done = bf16[128]{0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %ag-start = (bf16[128]{0}, bf16[1024]{0}) all-gather-start(%rs-done), channel_id=5, \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[1024]{0} all-gather-done(%ag-start)
  ROOT %t = (s32[], bf16[1024]{0}) tuple(%i, %ag-done)
}

%cond (cp: (s32[], bf16[1024])) -> pred[] {
  %cp = (s32[], bf16[1024]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (p0: f32[1024], p1: f32[16], p2: f32[8], p3: bf16[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %p2 = f32[8]{0} parameter(2)
  %p3 = bf16[1024]{0} parameter(3)
  %ar-start = f32[1024]{0} all-reduce-start(%p0), channel_id=1, \
replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ar-done = f32[1024]{0} all-reduce-done(%ar-start)
  %cp-start = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%ar-done), \
channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cp-done = f32[1024]{0} collective-permute-done(%cp-start)
  %a2a-start = ((f32[1024]{0}), f32[1024]{0}) all-to-all-start(%cp-done), channel_id=6, \
replica_groups=mesh['x'=8] {'x'}, dimensions={0}
  %a2a-done = f32[1024]{0} all-to-all-done(%a2a-start)
  %comb = (f32[16]{0}, f32[8]{0}) all-reduce(%p1, %p2), channel_id=3, replica_groups={}, \
to_apply=%add
  %zero = s32[] constant(0)
  %init = (s32[], bf16[1024]{0}) tuple(%zero, %p3)
  %loop = (s32[], bf16[1024]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[1024]{0} add(%a2a-done, %a2a-done)
}
"""


def test_gpu_async_forms_count_once():
    cs = collectives(_GPU)
    got = [(c.name, c.kind, c.dtype, c.shape, c.group_size, c.trip_count) for c in cs]
    assert sorted(got) == sorted(
        [
            ("rs", "reduce-scatter", "bf16", (128,), 8, 4),
            ("ag-done", "all-gather", "bf16", (1024,), 8, 4),
            ("ar-done", "all-reduce", "f32", (1024,), 4, 1),
            ("cp-done", "collective-permute", "f32", (1024,), 4, 1),
            ("a2a-done", "all-to-all", "f32", (1024,), 8, 1),
            ("comb", "all-reduce", "f32", (16,), 8, 1),
            ("comb", "all-reduce", "f32", (8,), 8, 1),
        ]
    )
    rs = next(c for c in cs if c.kind == "reduce-scatter")
    assert (rs.computation, rs.operand_bytes, rs.result_bytes) == (
        "wrapped_reduce_scatter",
        2048,
        256,
    )
    assert comm_bytes(cs) == _bytes(
        **{
            "all-reduce": 2 * 4096 * 3 / 4 + 2 * 96 * 7 / 8,
            "reduce-scatter": 4 * 2048 * 7 / 8,
            "all-gather": 4 * 2048 * 7 / 8,
            "other": 4096 + 4096 * 7 / 8,
        }
    )


def test_summary_table():
    cs = collectives(_GPU)
    lines = summary_table(cs).splitlines()
    assert lines[0].split()[:5] == ["kind", "dtype", "shape", "group", "trips"]
    assert len(lines) == 1 + len(cs) + 1
    assert lines[-1].startswith("total") and lines[-1].endswith(f"{comm_bytes(cs)['total']:,.0f}")
    assert all(isinstance(c, Collective) for c in cs)


def test_dot_flops_counts_each_run_of_a_loop_body():
    """2·M·N·K per dot, times its computation's runs: a scan over 3 layers of a [4,8] x
    [8,16] matmul, as jax compiles it, is 3 · 2·4·16·8 FLOPs (cost_analysis counts one)."""
    w = jnp.ones((3, 8, 16))

    def f(x, w):
        return jax.lax.scan(lambda c, wi: (c, c @ wi), x, w)[1]

    compiled = jax.jit(f).lower(jnp.ones((4, 8)), w).compile()
    assert dot_flops(compiled.as_text()) == 3 * 2 * 4 * 16 * 8
    once = jax.jit(lambda x, w: x @ w[0]).lower(jnp.ones((4, 8)), w).compile()
    assert dot_flops(once.as_text()) == 2 * 4 * 16 * 8


def test_launches_counts_a_combined_collective_once_and_each_run_of_a_loop():
    def one(name, computation="main", trips=1):
        return Collective("all-reduce", "f32", (4,), 8, 16, 16, trips, computation, name)

    combined = [one("ar.1"), one("ar.1")]  # one tuple-shaped all-reduce of two arrays
    looped = [one("ag.2", "body", 6), one("rs.3", "body", None)]  # unknown trips: once
    assert launches(combined + looped) == 1 + 6 + 1
