"""The compiled program's peak per memory space (jzero.report's ``peak_bytes_by_space``).

XLA:CPU's memory analysis has one memory: offloading shows no saving there. The replay of
the scheduled HLO (jzero.accounting.memory_spaces) does: on hand-written programs its
bytes are exact; without offload the device's peak is XLA's own; and each offload mode
takes from the device's peak at least what it keeps in host memory.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import stacked_batch, stacked_loss, stacked_params

import jzero
from jzero.accounting.memory_spaces import peak_by_space

BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
MODES = {
    "none": None,
    "stream": jzero.Offload(optimizer="stream"),
    "host": jzero.Offload(optimizer="host"),
    "params": jzero.Offload(optimizer="host", params=True),
    "params_stream": jzero.Offload(optimizer="stream", params=True),
    "params_only": jzero.Offload(params=True),
}
# The largest stored piece of state that streams through the device, in flight twice at
# once (jzero.core.offload.update: piece k is copied in once piece k-2 is back): a [4, W/8,
# W] stacked weight's Adam moments and fp32 master, per device, W = 256.
PIECE = 4 * 32 * 256 * 4 * 3
ALLOWANCE = 2 * PIECE


def _program(body: str, layout: str, alias: str = "") -> str:
    head = f"HloModule m, is_scheduled=true{alias}, entry_computation_layout={{{layout}}}"
    return head + "\n\n" + body


def test_a_device_read_of_a_host_parameter_is_a_device_copy():
    hlo = _program(
        "ENTRY %main (p: f32[256], q: f32[256]) -> f32[256] {\n"
        "  %p = f32[256]{0} parameter(0)\n"
        "  %q = f32[256]{0} parameter(1)\n"
        "  ROOT %a = f32[256]{0} add(%p, %q)\n"
        "}\n",
        "(f32[256]{0:S(5)}, f32[256]{0})->f32[256]{0}",
    )
    # device: q (1 KiB), the output (1 KiB) and p's copy while the add runs (1 KiB)
    assert peak_by_space(hlo) == {"device": 3072, "pinned_host": 1024}


def test_a_result_returned_in_host_memory_is_held_on_the_device_only_while_written():
    hlo = _program(
        "ENTRY %main (p: f32[256]) -> (f32[256], f32[256]) {\n"
        "  %p = f32[256]{0} parameter(0)\n"
        "  %m = f32[256]{0} multiply(%p, %p)\n"
        "  %n = f32[256]{0} negate(%m)\n"
        "  ROOT %t = (f32[256]{0}, f32[256]{0}) tuple(%m, %n)\n"
        "}\n",
        "(f32[256]{0})->(f32[256]{0:S(5)}, f32[256]{0})",
    )
    # device: p, n, and m while multiply writes it and negate reads it; host: m
    assert peak_by_space(hlo) == {"device": 3072, "pinned_host": 1024}


def test_a_host_computation_keeps_its_values_in_host_memory():
    hlo = _program(
        "ENTRY %main (g: f32[256]) -> f32[256] {\n"
        "  %g = f32[256]{0} parameter(0)\n"
        '  %h = f32[256]{0} multiply(%g, %g), frontend_attributes={_xla_compute_type="host"}\n'
        '  %k = f32[256]{0} negate(%h), metadata={op_name="jit(step)/compute_on/neg"}\n'
        "  ROOT %r = f32[256]{0} add(%k, %g)\n"
        "}\n",
        "(f32[256]{0})->f32[256]{0}",
    )
    # host: g's copy and h while multiply runs, then h and k; device: g, r and k's copy
    assert peak_by_space(hlo) == {"device": 3072, "pinned_host": 2048}


def test_a_loop_body_adds_its_own_peak_and_a_donated_result_costs_nothing():
    hlo = _program(
        "%body (s: (s32[], f32[256])) -> (s32[], f32[256]) {\n"
        "  %s = (s32[], f32[256]{0}) parameter(0)\n"
        "  %i = s32[] get-tuple-element(%s), index=0\n"
        "  %x = f32[256]{0} get-tuple-element(%s), index=1\n"
        "  %t = f32[1024]{0} broadcast(%i), dimensions={}\n"
        "  %y = f32[256]{0} slice(%t), slice={[0:256]}\n"
        "  ROOT %o = (s32[], f32[256]{0}) tuple(%i, %y)\n"
        "}\n\n"
        "%cond (s: (s32[], f32[256])) -> pred[] {\n"
        "  %s = (s32[], f32[256]{0}) parameter(0)\n"
        "  ROOT %c = pred[] constant(false)\n"
        "}\n\n"
        "ENTRY %main (p: f32[256]) -> f32[256] {\n"
        "  %p = f32[256]{0} parameter(0)\n"
        "  %z = s32[] constant(0)\n"
        "  %in = (s32[], f32[256]{0}) tuple(%z, %p)\n"
        "  %w = (s32[], f32[256]{0}) while(%in), condition=%cond, body=%body\n"
        "  ROOT %r = f32[256]{0} get-tuple-element(%w), index=1\n"
        "}\n",
        "(f32[256]{0})->f32[256]{0}",
        alias=", input_output_alias={ {}: (0, {}, may-alias) }",
    )
    # p (1 KiB) + the body's broadcast (4 KiB) and slice (1 KiB); a constant is the
    # executable's, not a buffer (as XLA counts it)
    assert peak_by_space(hlo) == {"device": 1024 + 4096 + 1024, "pinned_host": 0}


def test_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        peak_by_space("HloModule m\n")


@functools.cache
def _report(stage: int, mode: str, mixed: bool) -> jzero.Report:
    opt = jzero.ZeroOptimizer(
        optax.adamw(1e-3), jzero.data_mesh(), stage=stage, min_shard_size=1,
        offload=MODES[mode], precision=BF16 if mixed else None,
    )  # fmt: skip
    state = opt.init(stacked_params(layers=4, width=256))
    return jzero.report(opt.train_step(stacked_loss), state, stacked_batch(width=256))


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_without_offload_the_device_peak_is_within_xlas_packing(stage, mixed):
    """No host memory: the replay's peak against XLA's ``argument + output + temp -
    alias`` for the same schedule. Measured on these programs: equal to 0.1 % but for
    mixed precision at stage 2, 0.79 x, where XLA keeps a donated parameter's buffer for
    the result it will hold instead of lending it to temporaries in between (on the
    benchmark's GPT, 0.97-1.12 x: prefetch's loop carries the next layer, which XLA
    packs tighter)."""
    rep = _report(stage, "none", mixed)
    assert rep.peak_bytes_by_space["pinned_host"] == 0
    assert 0.75 * rep.peak_bytes <= rep.peak_bytes_by_space["device"] <= 1.001 * rep.peak_bytes


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize(
    ("stage", "mode"),
    [
        (2, "stream"),
        (2, "host"),
        (3, "stream"),
        (3, "host"),
        (3, "params"),
        (3, "params_stream"),
        (3, "params_only"),
    ],
)
def test_offload_takes_what_rests_on_the_host_off_the_device_peak(stage, mode, mixed):
    """The device's peak falls by at least the bytes that rest in host memory, less two
    pieces of streamed state (ALLOWANCE); XLA:CPU's own peak does not (or barely) move."""
    none, rep = _report(stage, "none", mixed), _report(stage, mode, mixed)
    on_host = rep.bytes_by_memory_kind["pinned_host"]
    assert on_host > 0
    # what the CPU's memory analysis cannot see: its peak moves by far less than the bytes
    # resting on the host (by 128 B in the streamed modes: their grad-norm barrier)
    assert abs(rep.peak_bytes - none.peak_bytes) < on_host / 100
    saved = none.peak_bytes_by_space["device"] - rep.peak_bytes_by_space["device"]
    assert saved >= on_host - ALLOWANCE
    assert rep.peak_bytes_by_space["pinned_host"] >= on_host
    assert "in pinned_host (schedule)" in str(rep)


@pytest.mark.parametrize("mixed", [False, True])
def test_the_host_step_keeps_state_and_master_weights_off_the_device(mixed):
    """The host step's device peak is the no-offload peak less all of the resting state
    and master weights, exactly: none of it is ever on the device."""
    none, host = _report(3, "none", mixed), _report(3, "host", mixed)
    on_host = host.bytes_by_memory_kind["pinned_host"]
    assert none.peak_bytes_by_space["device"] - host.peak_bytes_by_space["device"] == on_host


def test_parameter_offload_takes_the_parameter_shards_off_too():
    host, params = _report(3, "host", True), _report(3, "params", True)
    moved = params.params_bytes_by_memory_kind["pinned_host"]
    saved = host.peak_bytes_by_space["device"] - params.peak_bytes_by_space["device"]
    assert moved > 0 and saved >= moved


LAYERS, WIDTH = 8, 128


def _unrolled_params() -> dict:
    """Eight equal weights, so that a ratio's share of the leaves is exact."""
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return {f"l{i}": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for i, k in enumerate(keys)}


def _unrolled_loss(params, batch):
    x_BxD = batch["x"]
    for i in range(LAYERS):
        x_BxD = jnp.tanh(x_BxD @ params[f"l{i}"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


@functools.cache
def _device_peak(stage: int, mixed: bool, ratio: float | None) -> int:
    offload = None if ratio is None else jzero.Offload(optimizer="host", ratio=ratio)
    opt = jzero.ZeroOptimizer(
        optax.adamw(1e-3), jzero.data_mesh(), stage=stage, offload=offload,
        precision=BF16 if mixed else None,
    )  # fmt: skip
    batch = {"x": jnp.ones((16, WIDTH)), "y": jnp.zeros((16, WIDTH))}
    rep = jzero.report(opt.train_step(_unrolled_loss), opt.init(_unrolled_params()), batch)
    return rep.peak_bytes_by_space["device"]


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_partial_host_step_moves_the_device_peak_linearly_in_its_ratio(stage, mixed):
    """``Offload(optimizer="host", ratio=r)``: the device's peak lies between no offload's
    and the whole offload's, and what it saves is r x the whole offload's saving, within 10 %
    of that saving (measured: exact but for stage 2 at fp32, 5 % under)."""
    none, whole = _device_peak(stage, mixed, None), _device_peak(stage, mixed, 1.0)
    assert whole < none
    for ratio in (0.25, 0.5, 0.75):
        peak = _device_peak(stage, mixed, ratio)
        assert whole < peak < none
        assert abs((none - peak) - ratio * (none - whole)) <= 0.1 * (none - whole)
