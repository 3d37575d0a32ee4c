"""Parameter offload (ZeRO-Infinity's ``offload_param``: ``jzero.Offload(params=True)``), on
8 CPU devices.

Stage 3's parameter shards (and their fp32 master weights) rest in pinned host memory;
each gather copies its layer's shards to the device first, in forward and again in
backward. XLA:CPU has one memory: jax lowers the copies to nothing there and its memory
analysis counts no host memory. So these tests check placement (every leaf's memory
kind), where the copies sit in the traced step (inside the per-layer loops, forward and
backward; and in the program lowered for GPU), numerics (bitwise those of the run without
offload, and single-device Optax), checkpoints, and the estimator's host bytes against
the live arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo_text import loop_bodies
from _models import (
    assert_tree_close,
    awkward_batches,
    awkward_loss,
    awkward_params,
    reference,
    stacked_batch,
    stacked_params,
)
from _offload import HOST, TXS, full_parts, memory_kinds

import jzero
from jzero.internal.equation import walk
from jzero.internal.primitives import is_copy_to_device

BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
FP32 = jzero.Precision()


def _opt(tx: str, precision, params: bool, optimizer: str | None = None, **kw):
    offload = jzero.Offload(params=params, optimizer=optimizer)
    return jzero.ZeroOptimizer(
        TXS[tx], jzero.data_mesh(), stage=3, precision=precision, offload=offload, **kw
    )


@functools.cache
def _run(tx: str, precision, params: bool, optimizer: str | None = None, steps: int = 4):
    """``steps`` steps of the awkward model (leaves of prime sizes, a scalar) at stage 3."""
    opt = _opt(tx, precision, params, optimizer, min_shard_size=1)
    state, step = opt.init(awkward_params()), opt.train_step(awkward_loss)
    at_init = state
    losses = []
    for batch in awkward_batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return opt, jax.tree.map(lambda x: x.sharding.memory_kind, at_init), state, losses


@pytest.mark.parametrize("optimizer", [None, "stream", "host"])
def test_sharded_parameters_and_master_rest_on_the_host(optimizer):
    opt, at_init, state, _ = _run("adam", BF16, True, optimizer)
    planned = {"emb": HOST, "w1": HOST, "b1": HOST, "w2": HOST, "b2": HOST, "s": "device"}
    # The scalar is never sharded: it stays on the device, and so do its master weights
    # unless the optimizer (which owns them) is offloaded.
    master = planned | {"s": HOST if optimizer else "device"}
    assert (at_init.params, at_init.master) == (planned, master)
    kinds = lambda tree: jax.tree.map(lambda x: x.sharding.memory_kind, tree)
    assert (kinds(state.params), kinds(state.master)) == (planned, master)
    opt_kind = HOST if optimizer else "device"
    assert memory_kinds(state.opt_state) == set(jax.tree.leaves(at_init.opt_state)) == {opt_kind}
    # The same layout as without offload, in another memory.
    _, _, plain, _ = _run("adam", BF16, False, optimizer)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        assert got.sharding.spec == want.sharding.spec
        assert got.addressable_data(0).shape == want.addressable_data(0).shape
    # Plan.describe shows where each leaf and its master weights rest, and the state.
    rows = opt.plan(awkward_params()).describe().splitlines()
    head = ["leaf", "shape", "shard", "dim", "stored", "pad", "spec", "update", "memory", "master"]
    head += ["memory"]
    assert rows[0].split() == head
    described = {r.split()[0]: r.split()[-2:] for r in rows[1:-1]}
    assert described == {f"['{k}']": [planned[k], master[k]] for k in planned}
    assert rows[-1] == f"optimizer state in {opt_kind}"


@pytest.mark.parametrize(
    ("tx", "precision", "optimizer"),
    [
        ("adam", FP32, None),
        ("adam", BF16, None),
        ("clip_adamw", BF16, None),
        ("adafactor", BF16, None),
        ("adam", BF16, "stream"),
        ("clip_adamw", FP32, "stream"),
        ("clip_adamw", BF16, "host"),
    ],
)
def test_numerics_are_those_of_the_run_without_offload(tx, precision, optimizer):
    # The copies move bytes and change no arithmetic: bitwise the same run.
    opt, _, state, losses = _run(tx, precision, True, optimizer)
    _, _, plain, plain_losses = _run(tx, precision, False, optimizer)
    assert losses == plain_losses
    for got, want in zip(
        jax.tree.leaves(full_parts(opt, state)), jax.tree.leaves(full_parts(opt, plain))
    ):
        np.testing.assert_array_equal(got, want)


def test_fp32_matches_single_device_optax():
    opt, _, state, losses = _run("clip_adamw", FP32, True)
    ref = reference(TXS["clip_adamw"], awkward_params(), awkward_loss, awkward_batches(4))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-6)
    params, opt_state, _ = full_parts(opt, state)
    assert_tree_close(params, ref.params, rtol=1e-6, atol=1e-6)
    assert_tree_close(opt_state, ref.opt_state, rtol=1e-6, atol=1e-6)


def _layer(p, x_BxD):
    return jnp.tanh(x_BxD @ p["w"] + p["b"])


def _scan_loss(params, batch):
    x_BxD, _ = jax.lax.scan(lambda x, p: (_layer(p, x), None), batch["x"], params["layers"])
    return jnp.mean((x_BxD - batch["y"]) ** 2)


def _manual_loss(policy):
    layer = jzero.remat_layer(_layer, policy=policy)

    def loss_fn(params, batch):
        x_BxD, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), batch["x"], params["layers"])
        return jnp.mean((x_BxD - batch["y"]) ** 2)

    return loss_fn


STEPS = {  # gathering mode -> (loss, optimizer options, train_step options)
    "default": (_scan_loss, {}, {}),
    "prefetch": (_scan_loss, {"comm": jzero.Communication(prefetch=True)}, {}),
    "bucket": (_scan_loss, {"comm": jzero.Communication(bucket=True)}, {}),
    "remat_layer": (_manual_loss(None), {}, {"manual_gather": True}),
    "remat_layer_saving": (
        _manual_loss(jax.checkpoint_policies.everything_saveable),
        {},
        {"manual_gather": True},
    ),
}


def _count(jaxpr, pred) -> int:
    return sum(1 for e in walk(jaxpr) if pred(e.jaxpr_eqn))


def _copies_in(eqn) -> bool:
    return is_copy_to_device(eqn.primitive, eqn.params)


def _gathers(eqn) -> bool:
    return eqn.primitive is jax.lax.all_gather_p


@pytest.mark.parametrize("mode", sorted(STEPS))
def test_every_gather_in_the_layer_loops_copies_its_shards_in_first(mode):
    loss_fn, kw, options = STEPS[mode]
    opt = _opt("adam", FP32, True, **kw)
    state, batch = opt.init(stacked_params()), stacked_batch()
    step = opt.train_step(loss_fn, **options)
    jaxpr = jax.make_jaxpr(step)(state, batch)
    loops = [
        e.jaxpr_eqn.params["jaxpr"] for e in walk(jaxpr) if e.jaxpr_eqn.primitive.name == "scan"
    ]
    gathering = [body for body in loops if _count(body, _gathers)]
    # Forward's loop and backward's each gather layer by layer, and every one of those
    # gathers copies the layer's shards in from host memory first (bucketed: one flat
    # all-gather for the layer's two copies).
    assert len(gathering) >= 2, mode
    for body in gathering:
        per_gather = 2 if mode == "bucket" else 1
        assert _count(body, _copies_in) == per_gather * _count(body, _gathers), mode
    # No shard is gathered outside the loops but, with prefetch, the first layer of each
    # pass, fetched before its loop (the update's copies name a sharding, not a memory).
    outside = _count(jaxpr, _copies_in) - sum(_count(b, _copies_in) for b in gathering)
    assert outside == (2 * len(jax.tree.leaves(state.params)) if mode == "prefetch" else 0)
    # And the step is bitwise the one without offload.
    plain = _opt("adam", FP32, False, **kw)
    new, metrics = step(state, batch)
    want, want_metrics = plain.train_step(loss_fn, **options)(plain.init(stacked_params()), batch)
    assert float(metrics["loss"]) == float(want_metrics["loss"])
    for got, ref in zip(
        jax.tree.leaves(full_parts(opt, new)), jax.tree.leaves(full_parts(plain, want))
    ):
        np.testing.assert_array_equal(got, ref)


def test_the_gpu_program_copies_in_per_layer_inside_the_loops():
    opt = _opt("adam", FP32, True)
    state, batch = opt.init(stacked_params()), stacked_batch()
    step = opt.train_step(_scan_loss)
    # Lowered for GPU (no GPU needed): there jax emits the memory moves XLA:CPU drops.
    text = jax.jit(step).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    to_device = '_xla_buffer_placement = "device"'
    per_loop = [body.count(to_device) for body in loop_bodies(text)]
    # In the loop bodies: w and b copied in forward, w alone in backward (b's gathered
    # value is not needed to differentiate x @ w + b). In the step itself, the update's two
    # copies of the fp32 parameters it updates (no master weights).
    assert sorted(n for n in per_loop if n) == [1, 2]
    assert text.count(to_device) - sum(per_loop) == 2
    assert text.count('_xla_buffer_placement = "pinned_host"') == 2  # both written back


def test_checkpoint_round_trip_restores_to_host_memory(tmp_path):
    opt, _, state, _ = _run("adam", BF16, True)
    with jzero.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(4, state)
        restored = ckpt.restore(opt, awkward_params()).state
    for field in ("params", "master", "opt_state"):
        got, want = getattr(restored, field), getattr(state, field)
        assert jax.tree.map(lambda x: x.sharding, got) == jax.tree.map(lambda x: x.sharding, want)
    for got, want in zip(
        jax.tree.leaves(full_parts(opt, restored)), jax.tree.leaves(full_parts(opt, state))
    ):
        np.testing.assert_array_equal(got, want)
    step, batch = opt.train_step(awkward_loss), awkward_batches(5)[4]
    (a, ma), (b, mb) = step(restored, batch), step(jax.tree.map(jnp.copy, state), batch)
    assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(full_parts(opt, a)), jax.tree.leaves(full_parts(opt, b))):
        np.testing.assert_array_equal(x, y)


def test_estimate_counts_the_host_bytes_the_live_state_holds():
    # Every leaf divides 8 ways (no padding, none too small): the estimator's formulas are
    # exact for the arrays at rest.
    params = stacked_params(layers=4, width=64)
    psi = sum(x.size for x in jax.tree.leaves(params))
    opt = _opt("adam", BF16, True)
    state = opt.init(params)
    shard = lambda tree: sum(x.addressable_data(0).nbytes for x in jax.tree.leaves(tree))
    on_host = shard((state.params, state.master))
    est = jzero.estimate(
        params=psi, devices=8, stage=3, largest_layer_params=psi / 4, offload_params=True
    )
    plain = jzero.estimate(params=psi, devices=8, stage=3, largest_layer_params=psi / 4)
    assert est.host_bytes == on_host == (2 + 4) * psi / 8  # bf16 shards + fp32 master
    assert est.params_bytes == plain.params_bytes / 4  # one layer's shards copied in
    assert est.optimizer_bytes == plain.optimizer_bytes  # the update copies the master in
    assert est.grads_bytes == plain.grads_bytes
    prefetching = jzero.estimate(
        params=psi, devices=8, stage=3, largest_layer_params=psi / 4, offload_params=True,
        prefetch=True,
    )  # fmt: skip
    assert prefetching.params_bytes == 2 * est.params_bytes
    both = jzero.estimate(
        params=psi, devices=8, stage=3, largest_layer_params=psi / 4, offload_params=True,
        offload="optimizer",
    )  # fmt: skip
    assert both.host_bytes == (2 + 12) * psi / 8  # master counted once, in K
    rep = jzero.report(opt.train_step(_scan_loss), state, stacked_batch())
    assert rep.bytes_by_memory_kind == {"device": shard(state.opt_state), HOST: on_host}
    assert rep.params_bytes_by_memory_kind == {HOST: shard(state.params)}
    # Printed under each state: the parameters' host bytes, then the optimizer state's
    # (its Optax state on the device, its master weights on the host).
    lines = str(rep).splitlines()
    at = lambda name: next(i for i, line in enumerate(lines) if line.startswith(name))
    assert lines[at("params") + 1].split() == ["in", HOST, f"{shard(state.params):,}"]
    opt_rows = lines[at("optimizer state") + 1 : at("model states")]
    assert [r.split() for r in opt_rows] == [
        ["in", "device", f"{shard(state.opt_state):,}"],
        ["in", HOST, f"{shard(state.master):,}"],
    ]


def test_estimate_refuses_parameter_offload_below_stage_3():
    with pytest.raises(ValueError, match="offload_params=True needs stage 3"):
        jzero.estimate(params=1000, devices=4, stage=2, offload_params=True)
    with pytest.raises(ValueError, match="offload_params must be True or False"):
        jzero.estimate(params=1000, devices=4, stage=3, offload_params="cpu")
