"""The optimizer step on the host (``Offload(optimizer="host")``), on 8 CPU devices.

XLA:CPU runs ``compute_on("device_host")`` on the same cores and memory as its "device",
so these tests check placement (the memory kind every leaf rests in, what the compiled
step copies between memories) and numerics: bitwise those of the same run without offload
(each bucket evaluates the very equations of the whole-tree update, and the host divides
the reduced gradient as the step does), and single-device Optax at fp32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import awkward_batches, awkward_loss, awkward_params, reference
from _offload import (
    HOST,
    HOST_BF16,
    TXS,
    assert_as_reference,
    assert_as_without_offload,
    assert_overflow_skipped_as_without_offload,
    memory_kinds,
    offload_opt,
    run_awkward,
)

import jzero

BF16 = HOST_BF16
FP16 = jzero.Precision(param_dtype=jnp.float16, initial_loss_scale=2.0**10)
ON_HOST = jzero.Offload(optimizer="host")


_opt, _run = offload_opt, run_awkward


@pytest.mark.parametrize(
    ("stage", "tx"),
    [
        *[pytest.param(*c, marks=pytest.mark.slow) for c in [(1, "adam"), (2, "adam")]],
        pytest.param(3, "clip_adamw", marks=pytest.mark.slow),
        (3, "adam"),
        (2, "adafactor"),
        (1, "adam_clip"),
    ],
)
def test_host_step_places_the_state_on_host_and_matches_the_device_run(stage, tx):
    opt, state, losses = _run(stage, tx, ON_HOST)
    assert state.plan.config.offload.optimizer == "host" and state.plan.config.offload == ON_HOST
    assert memory_kinds((state.opt_state, state.master)) == {HOST}
    assert memory_kinds(state.params) == {"device"}
    _, plain, plain_losses = _run(stage, tx, None)
    assert_as_without_offload(opt, state, losses, plain, plain_losses)


def test_host_step_fp32_matches_single_device_optax():
    """fp32: no master weights; the parameters rest on the device and go down per leaf."""
    opt, state, losses = _run(2, "clip_adamw", ON_HOST, jzero.Precision())
    assert state.master is None and memory_kinds(state.opt_state) == {HOST}
    ref = reference(TXS["clip_adamw"], awkward_params(), awkward_loss, awkward_batches(4))
    assert_as_reference(opt, state, losses, ref)


def test_fp16_overflow_skips_the_host_update_as_without_offload():
    good, bad = awkward_batches(2)
    bad = {"x": (bad["x"] * 1e4).astype(jnp.float16), "y": bad["y"]}  # overflows fp16
    make_opt = lambda offload: _opt(2, "adam", offload, FP16)
    assert_overflow_skipped_as_without_offload(
        make_opt, awkward_params(), awkward_loss, (good, bad, good), ON_HOST
    )


def test_each_leaf_is_updated_in_its_own_host_computation():
    """The lowered step calls one ``compute_on('device_host')`` computation per parameter
    leaf (Adam splits per leaf), which takes the gradient in the reduce dtype and returns
    the parameter in the parameter dtype (bf16 both), and the compiled step takes the Optax
    state and master weights in host memory (memory space S(5))."""
    opt, state, _ = _run(3, "adam", ON_HOST)
    lowered = opt.train_step(awkward_loss, donate=False).lower(state, awkward_batches(1)[0])
    calls = [line for line in lowered.as_text().splitlines() if "call @update" in line]
    assert len(calls) == len(state.plan.params)
    assert all('{_xla_compute_type = "host"}' in line for line in calls)
    assert all(re.search(r": \(tensor<[0-9x]*bf16>, ", line) for line in calls)  # gradient
    assert all(line.endswith("bf16>)") for line in calls)  # the new parameter
    entry = lowered.compile().as_text().split("entry_computation_layout={(")[1].split(")->")[0]
    n_host = len(jax.tree.leaves((state.opt_state, state.master)))
    assert entry.count("S(5)") == n_host  # the state and master weights; no parameter


@pytest.mark.parametrize("offload", [ON_HOST, jzero.Offload(optimizer="host", ratio=0.8)])
def test_checkpoint_round_trips_a_host_step_state_bitwise(tmp_path, offload):
    """The whole state on the host, and a partial offload (the awkward model's b1, b2 and
    emb: 0.81 of its parameters) whose leaves rest in both memories."""
    opt, state, _ = _run(3, "adam", offload)
    ckpt = jzero.Checkpointer(tmp_path)
    ckpt.save(4, state, force=True)
    ckpt.wait()
    restored = ckpt.restore(opt, awkward_params()).state
    ckpt.close()
    assert restored.plan == state.plan
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding == want.sharding  # memory kind included
        np.testing.assert_array_equal(np.asarray(jax.device_get(got)), jax.device_get(want))


def test_offload_options_are_checked_with_the_fix():
    mesh = jzero.data_mesh()
    with pytest.raises(ValueError, match=r"^Offload\.optimizer must be None, 'stream' .* 'cpu'"):
        jzero.Offload(optimizer="cpu")
    with pytest.raises(TypeError, match="Offload.params must be True or False"):
        jzero.Offload(params=1)
    with pytest.raises(ValueError, match=re.escape("Offload(params=True) keeps stage 3's")):
        jzero.ZeroOptimizer(TXS["adam"], mesh, stage=2, offload=jzero.Offload(params=True))
    with pytest.raises(ValueError, match=re.escape("Offload(optimizer='host') needs stage >= 1")):
        jzero.ZeroOptimizer(TXS["adam"], mesh, stage=0, offload=ON_HOST)
    with pytest.raises(ValueError, match="offload must be None, 'optimizer' .* got 'host'"):
        jzero.ZeroOptimizer(TXS["adam"], mesh, stage=1, offload="host")
    assert jzero.ZeroOptimizer(TXS["adam"], mesh, stage=1, offload="optimizer").offload == (
        jzero.Offload(optimizer="stream")
    )


def test_state_of_another_offload_mode_is_refused():
    _, state, _ = _run(3, "adam", ON_HOST)
    stream = _opt(3, "adam", "optimizer")
    error = (
        "state was made by an optimizer with offload=Offload(optimizer='host'), but this "
        "optimizer has offload='optimizer'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
        stream.train_step(awkward_loss, donate=False)(state, awkward_batches(1)[0])


def _even_params():
    """Leaves that 8 devices divide evenly (no padding): bytes are exactly Ψ/N per device."""
    key = jax.random.key(0)
    return {"w": jax.random.normal(key, (64, 32)) / 8, "b": jnp.zeros((32,))}


def _even_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _per_device(tree) -> dict[str, int]:
    """Bytes one device holds of ``tree``'s leaves, by memory kind."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        kind = x.sharding.memory_kind
        out[kind] = out.get(kind, 0) + x.addressable_data(0).nbytes
    return out


@pytest.mark.parametrize("mode", [None, "stream", "host"])
def test_estimate_device_and_host_bytes_match_the_live_state_and_the_compiled_step(mode):
    """bf16 Adam at stage 3: the estimate's device and host model-state bytes are those the
    live state holds per device (host: + Adam's int32 count, replicated); the compiled
    step's arguments are the state and the batch, whichever memory the backend counts
    them in (XLA:CPU reports no host_* bytes: it has one memory)."""
    params = _even_params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    offload = None if mode is None else jzero.Offload(optimizer=mode)
    opt = jzero.ZeroOptimizer(TXS["adam"], jzero.data_mesh(), stage=3, precision=BF16,
                              offload=offload)  # fmt: skip
    state = opt.init(params)
    est = jzero.estimate(params=psi, devices=8, stage=3, offload=mode, largest_layer_params=psi)
    live = _per_device((state.params, state.opt_state, state.master))
    count = 4  # Adam's step count, int32, on every device
    if mode is None:
        assert live == {"device": est.params_bytes + est.optimizer_bytes + count}
    else:
        assert live == {"device": est.params_bytes, HOST: est.host_bytes + count}
        assert est.optimizer_bytes == (0 if mode == "host" else 2 * 12 * psi / 8)
    rows = jax.sharding.NamedSharding(opt.mesh, jax.sharding.PartitionSpec("data"))
    batch = jax.device_put({"x": jnp.ones((16, 64)), "y": jnp.ones((16, 32))}, rows)
    compiled = opt.train_step(_even_loss, donate=False).lower(state, batch).compile()
    memory = compiled.memory_analysis()
    arguments = memory.argument_size_in_bytes + memory.host_argument_size_in_bytes
    assert arguments == sum(_per_device((state, batch)).values())
    if memory.host_argument_size_in_bytes:  # a backend with host memory reports it apart
        assert memory.host_argument_size_in_bytes == live.get(HOST, 0)
