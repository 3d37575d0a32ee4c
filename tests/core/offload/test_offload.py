"""Optimizer offload (ZeRO-Offload) and offloaded activation checkpoints, on 8 CPU devices.

XLA:CPU has one memory: it compiles the copies between memory kinds inside a program
away, and its memory analysis shows no saving. These tests check placement (the memory
kind every leaf rests in), how the update is split into per-leaf buckets, and numerics
against the same run without offload (bitwise: the per-leaf update evaluates the very
equations of the whole-tree one) and against single-device Optax.
"""

from __future__ import annotations

import functools
import math
import re
import tempfile
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    assert_tree_close,
    awkward_batches,
    awkward_loss,
    awkward_params,
    reference,
    stacked_batch,
    stacked_params,
)
from _offload import (
    BF16,
    FP16,
    HOST,
    TXS,
    assert_as_reference,
    assert_as_without_offload,
    assert_overflow_skipped_as_without_offload,
    full_parts,
    memory_kinds,
)
from jax.ad_checkpoint import checkpoint_name

import jzero
from jzero.core.offload.split import split_update


@functools.cache
def _run(stage: int, tx: str, offload: str | None, precision=BF16, steps: int = 5):
    """``steps`` steps of the awkward model; the memory kinds after init, the last state."""
    opt = jzero.ZeroOptimizer(
        TXS[tx], jzero.data_mesh(), stage=stage, min_shard_size=1, precision=precision,
        offload=offload,
    )  # fmt: skip
    state = opt.init(awkward_params())
    at_init = memory_kinds((state.opt_state, state.master)), memory_kinds(state.params)
    step = opt.train_step(awkward_loss)
    losses = []
    for batch in awkward_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, step, at_init, state, losses


@pytest.mark.parametrize(
    ("stage", "tx"),
    [(1, "adam"), (2, "adam"), pytest.param(3, "adam", marks=pytest.mark.smoke), (3, "clip_adamw")]
    + [(2, "adafactor")],
)
def test_offloaded_state_rests_on_host_and_matches_the_device_run(stage, tx):
    opt, _, at_init, state, losses = _run(stage, tx, "optimizer")
    assert at_init == ({HOST}, {"device"})
    assert memory_kinds((state.opt_state, state.master)) == {HOST}
    assert memory_kinds(state.params) == {"device"}
    _, _, _, plain, plain_losses = _run(stage, tx, None)
    assert_as_without_offload(opt, state, losses, plain, plain_losses)


@pytest.mark.parametrize(("tx", "streams"), [*[(k, True) for k in TXS][:3], ("adam_clip", False)])
def test_update_splits_into_one_bucket_per_leaf(tx, streams):
    opt = jzero.ZeroOptimizer(TXS[tx], jzero.data_mesh(), stage=3, offload="optimizer")
    plan = opt.plan(awkward_params())
    split = split_update(TXS[tx], plan)
    assert split.streams == streams
    if not streams:  # one bucket: the whole tree
        assert [b.params for b in split.buckets] == [tuple(range(len(plan.params)))]
        return
    assert [b.params for b in split.buckets] == [(i,) for i in range(len(plan.params))]
    owned = sorted(j for b in split.buckets for j in b.opt)
    assert owned == sorted(set(range(len(plan.opt))) - set(split.shared))
    assert all(plan.opt[j].layout.shape == () for j in split.shared)  # counters only


@pytest.mark.parametrize("stage", [2, 3])
def test_the_streamed_step_orders_its_pieces_and_the_gradient_norm(stage):
    """The lowered streamed step holds one optimization barrier per piece from the third on
    (where its copy-in waits for piece k-2's write-backs and parameters) and one that
    computes the gradient norm before the state streams in; the device step holds none of
    them. (XLA:CPU drops the barriers when it compiles: the order they keep shows
    on a GPU, as the device peak.)"""
    barriers = []
    for offload in (None, "optimizer"):
        opt, step, _, state, _ = _run(stage, "adam", offload)
        lowered = step.lower(state, awkward_batches(1)[0]).as_text()
        barriers.append(lowered.count("stablehlo.optimization_barrier"))
    pieces = len(split_update(TXS["adam"], state.plan).buckets)  # one per leaf, unchunked
    assert pieces > 2
    assert barriers[1] - barriers[0] == (pieces - 2) + 1


def _moved(text: str) -> dict[str, int]:
    """Bytes a lowered program moves into each memory kind: its placement annotations'
    operands, by the shapes written (global outside ``shard_map``)."""
    found = re.findall(
        r'annotate_device_placement\(.*_xla_buffer_placement = "(\w+)".*?: \(tensor<([^>]*)>\)',
        text,
    )
    dtypes = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32}
    moved: dict[str, int] = {}
    for kind, shape in found:
        *dims, dtype = shape.split("x")
        size = math.prod(map(int, dims)) * jnp.dtype(dtypes[dtype]).itemsize
        moved[kind] = moved.get(kind, 0) + size
    return moved


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("chunk", [None, 64])
def test_the_streamed_step_moves_its_state_in_and_out_once(stage, chunk):
    """Over the link a streamed step moves every byte of the state resting in host memory
    to the device once and back once (2 x the state's bytes: what bounds its time on a
    link), read from the step lowered for ``cuda`` (XLA:CPU lowers the moves to nothing).
    In chunks (64 elements), the chunks brought in sum to the state; their write-backs are
    updates of the host buffer, which the text also annotates."""
    offload = jzero.Offload(optimizer="stream", chunk=chunk)
    opt = jzero.ZeroOptimizer(
        TXS["adam"], jzero.data_mesh(), stage=stage, min_shard_size=1, precision=BF16,
        offload=offload,
    )  # fmt: skip
    state = opt.init(awkward_params())
    step = opt.train_step(awkward_loss, donate=False)
    text = step.lower(state, awkward_batches(1)[0], platforms=("cuda",)).as_text()
    plan = state.plan
    resting = [s for s in plan.opt + (plan.master or ()) if s.memory_kind == HOST]
    state_bytes = sum(math.prod(s.layout.padded) * s.dtype.itemsize for s in resting)
    moved = _moved(text)
    assert moved["device"] == state_bytes
    if chunk is None:
        assert moved[HOST] == state_bytes


def test_whole_tree_fallback_fp32_matches_single_device_optax():
    # fp32: no master weights, the parameters stay on the device; only the Optax state
    # is offloaded. clip-after-Adam runs as one bucket.
    opt, _, at_init, state, losses = _run(2, "adam_clip", "optimizer", jzero.Precision())
    assert at_init == ({HOST}, {"device"}) and state.master is None
    ref = reference(TXS["adam_clip"], awkward_params(), awkward_loss, awkward_batches(5))
    assert_as_reference(opt, state, losses, ref)


def test_fp16_overflow_skips_the_offloaded_update():
    good, bad = awkward_batches(2)
    bad = {"x": (bad["x"] * 1e4).astype(jnp.float16), "y": bad["y"]}  # overflows fp16
    make_opt = lambda offload: jzero.ZeroOptimizer(
        TXS["adam"], jzero.data_mesh(), stage=2, precision=FP16, offload=offload
    )
    assert_overflow_skipped_as_without_offload(
        make_opt, awkward_params(), awkward_loss, (good, bad, good)
    )


def test_checkpoint_restores_an_offloaded_state_to_host_memory():
    opt, _, _, state, _ = _run(2, "adam", "optimizer")
    with tempfile.TemporaryDirectory() as d, jzero.Checkpointer(d, async_save=False) as ckpt:
        ckpt.save(5, state)
        restored = ckpt.restore(opt, awkward_params()).state
    assert memory_kinds((restored.opt_state, restored.master)) == {HOST}
    for got, want in zip(
        jax.tree.leaves(full_parts(opt, restored)), jax.tree.leaves(full_parts(opt, state))
    ):
        np.testing.assert_array_equal(got, want)


def test_report_counts_bytes_per_memory_kind():
    _, step, _, state, _ = _run(3, "adam", "optimizer")
    rep = jzero.report(step, state, awkward_batches(1)[0])
    shard = lambda tree: sum(x.addressable_data(0).nbytes for x in jax.tree.leaves(tree))
    assert rep.bytes_by_memory_kind == {
        "device": shard(state.params),
        HOST: shard((state.opt_state, state.master)),
    }
    assert f"in {HOST}" in str(rep)


def test_estimate_moves_the_optimizer_state_to_the_host():
    kw = dict(params=1000, devices=4, stage=2, largest_layer_params=100)
    plain, off = jzero.estimate(**kw), jzero.estimate(**kw, offload="optimizer")
    assert off.host_bytes == plain.optimizer_bytes == 12 * 1000 / 4
    assert off.optimizer_bytes == 2 * 12 * 100 / 4  # two layers' state streaming through
    assert (off.params_bytes, off.grads_bytes) == (plain.params_bytes, plain.grads_bytes)
    assert plain.host_bytes == 0 and off.to_dict()["host_bytes"] == off.host_bytes
    with pytest.raises(ValueError, match="needs stage >= 1"):
        jzero.estimate(params=1000, devices=4, stage=0, offload="optimizer")


def test_offload_errors():
    mesh = jzero.data_mesh()
    with pytest.raises(ValueError, match="offload must be None, 'optimizer' .* got 'cpu'"):
        jzero.ZeroOptimizer(TXS["adam"], mesh, stage=1, offload="cpu")
    with pytest.raises(ValueError, match="needs stage >= 1"):
        jzero.ZeroOptimizer(TXS["adam"], mesh, stage=0, offload="optimizer")
    # A backend whose devices have no host memory kind (stands in for one).
    memory = types.SimpleNamespace(kind="device")
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [memory])
    bare = types.SimpleNamespace(devices=np.array([device]))
    with pytest.raises(ValueError, match=r"the tpu backend's devices offer only \['device'\]"):
        jzero.Offload(optimizer="stream").check_backend(bare)


# Offloaded activation checkpoints (ZeRO-R): each layer's pre-activation goes to host memory.
OFFLOAD_HIDDEN = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["hidden"],
    offload_src="device",
    offload_dst=HOST,
)


def _layer(p, x_BxD):
    return jnp.tanh(checkpoint_name(x_BxD @ p["w"] + p["b"], "hidden"))


def _scanned_loss(block):
    def loss_fn(params, batch):
        body = lambda x_BxD, p: (block(p, x_BxD), None)
        x_BxD, _ = jax.lax.scan(body, batch["x"], params["layers"])
        return jnp.mean((x_BxD - batch["y"]) ** 2)

    return loss_fn


# The stacked model's smallest gradient is 7e-8 (median 2e-3): below Adam's default eps its
# rounding noise becomes +-lr updates (docs/design.md, "Traps"); eps 1e-3 is far above it.
ROBUST_ADAM = optax.adam(1e-2, eps=1e-3)


@pytest.mark.parametrize("stage", [0, 3])
def test_remat_layer_offloads_activations_never_gathered_params(stage):
    opt = jzero.ZeroOptimizer(ROBUST_ADAM, jzero.data_mesh(), stage=stage)
    results = {}
    for name, policy in (("recompute", None), ("offload", OFFLOAD_HIDDEN)):
        step = opt.train_step(
            _scanned_loss(jzero.remat_layer(_layer, policy=policy)), manual_gather=True
        )
        state, batch = opt.init(stacked_params()), stacked_batch()
        if policy is not None:  # what goes to the host: (layers, B/N, D) activations only
            jaxpr = str(jax.make_jaxpr(step)(state, batch))
            assert set(re.findall(r"f32<host>\[[\d,]*\]", jaxpr)) == {
                "f32<host>[2,64]",  # one layer's, inside the scan
                "f32<host>[4,2,64]",  # stacked over the 4 layers
            }
        for _ in range(3):
            state, _ = step(state, batch)
        results[name] = opt.full_params(state)
    for got, want in zip(
        jax.tree.leaves(results["offload"]), jax.tree.leaves(results["recompute"])
    ):
        np.testing.assert_array_equal(got, want)
    plain = _scanned_loss(lambda p, x: _layer(p, x))
    ref = reference(ROBUST_ADAM, stacked_params(), plain, [stacked_batch()] * 3)
    assert_tree_close(results["offload"], ref.params, rtol=1e-5, atol=1e-6)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x_BxD, _):
        w = self.param("w", nn.initializers.normal(0.1), (x_BxD.shape[-1],) * 2)
        return jnp.tanh(checkpoint_name(x_BxD @ w, "hidden")), None


class _Scanned(nn.Module):
    policy: Any = None

    @nn.compact
    def __call__(self, x_BxD):
        block = nn.remat(_Dense, policy=self.policy, prevent_cse=False)
        layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        return layers()(x_BxD, None)[0]


def test_flax_nn_remat_with_an_offloading_policy_in_stage_3s_default_gathering():
    # The default stage-3 step turns the user's nn.remat into jzero.remat_layer with the
    # same policy: activations named "hidden" go to host memory, never a gathered weight.
    batch = stacked_batch()
    finals = {}
    for name, policy in (("recompute", None), ("offload", OFFLOAD_HIDDEN)):
        model = _Scanned(policy)
        variables = model.init(jax.random.key(0), batch["x"])

        def loss(p, b, model=model):
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        state = jzero.linen.TrainState.create(
            apply_fn=model.apply, variables=variables, tx=TXS["adam"],
            mesh=jzero.data_mesh(), stage=3,
        )  # fmt: skip
        step = state.train_step(loss)
        if policy is not None:
            jaxpr = str(jax.make_jaxpr(step.core)(state.zero, batch))
            host = set(re.findall(r"f32<host>\[([\d,]*)\]", jaxpr))
            assert host and all(s.split(",")[-2:] != ["64", "64"] for s in host), host
        for _ in range(3):
            state, _ = step(state, batch)
        finals[name] = state.params
    ref = reference(TXS["adam"], variables["params"], loss, [batch] * 3)
    for got, want in zip(jax.tree.leaves(finals["offload"]), jax.tree.leaves(finals["recompute"])):
        np.testing.assert_array_equal(got, want)
    assert_tree_close(finals["offload"], ref.params, rtol=1e-5, atol=1e-6)
