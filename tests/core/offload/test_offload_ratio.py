"""A partial optimizer offload (``Offload(ratio=r)``, ZeRO-Offload++'s Twin-Flow), on 8 CPU
devices: the share r of the parameter leaves has its Optax state and master weights in host
memory, updated there (or streamed), and the rest is updated on the device in the same step.

Placement is checked leaf by leaf, numerics bitwise against the same run with the whole
state offloaded and without offload (each bucket evaluates the very equations of the
whole-tree update, wherever it runs), and the device's peak per memory space in
``tests/accounting/test_memory_spaces.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _models import awkward_batches, awkward_loss, awkward_params
from _offload import HOST, HOST_BF16, full_parts, offload_opt, run_awkward

import jzero
from jzero.core.options.offload import offloaded_leaves

LAYERS, WIDTH = 8, 16
AWKWARD_RATIO = 0.8  # the awkward model's b1, b2 and emb: 0.807 of its parameters


def _layers() -> dict[str, jax.Array]:
    """Eight equal weights: the ratio's share of them is exact."""
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return {f"l{i}": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for i, k in enumerate(keys)}


def _opt(tx: str, offload, *, stage: int = 2, precision=HOST_BF16) -> jzero.ZeroOptimizer:
    return offload_opt(stage, tx, offload, precision)


def test_the_nearest_prefix_of_the_leaves_is_offloaded():
    assert offloaded_leaves([1] * 8, 1.0) == [True] * 8
    assert offloaded_leaves([1] * 8, 0.5) == [True] * 4 + [False] * 4
    assert offloaded_leaves([1] * 8, 0.3) == [True] * 2 + [False] * 6  # 2.4 -> 2
    assert offloaded_leaves([1] * 8, 0.01) == [False] * 8  # below half a leaf: none
    assert offloaded_leaves([10, 1, 1], 0.5) == [True, False, False]  # 5.5 of 12 -> 10
    assert offloaded_leaves([1, 1, 10], 0.5) == [True, True, False]


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_each_leafs_state_rests_where_the_ratio_puts_it(ratio, mixed):
    offload = jzero.Offload(optimizer="host", ratio=ratio)
    opt = _opt("adam", offload, precision=HOST_BF16 if mixed else None)
    state = opt.init(_layers())
    on_host = round(ratio * LAYERS)
    mu = state.opt_state[0].mu  # adam's first moment, one leaf per layer
    kinds = [mu[f"l{i}"].sharding.memory_kind for i in range(LAYERS)]
    assert kinds == [HOST] * on_host + ["device"] * (LAYERS - on_host)
    if mixed:
        kinds = [state.master[f"l{i}"].sharding.memory_kind for i in range(LAYERS)]
        assert kinds == [HOST] * on_host + ["device"] * (LAYERS - on_host)
    assert state.opt_state[0].count.sharding.memory_kind == HOST  # Adam's shared count
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}


@pytest.mark.parametrize(
    ("stage", "tx", "mode"),
    [
        (3, "adam", "host"),
        (2, "clip_adamw", "host"),
        (2, "adafactor", "host"),
        (1, "adam_clip", "host"),  # one bucket: the whole update on the host
        (3, "clip_adamw", "stream"),
        pytest.param(2, "adam", "stream", marks=pytest.mark.slow),
    ],
)
def test_a_partial_offload_gives_the_numbers_of_the_whole_one(stage, tx, mode):
    """Bitwise the same run with the whole state offloaded, and (the host step) without
    offload; every leaf at rest where the plan puts it after the steps."""
    opt, state, losses = run_awkward(stage, tx, jzero.Offload(optimizer=mode, ratio=AWKWARD_RATIO))
    _, whole, whole_losses = run_awkward(stage, tx, jzero.Offload(optimizer=mode))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.opt_state, state.master))}
    assert kinds == {HOST, "device"}
    for got, stored in zip(jax.tree.leaves(state.opt_state), state.plan.opt):
        assert got.sharding.memory_kind == (stored.memory_kind or "device")
    assert losses == whole_losses
    for got, want in zip(
        jax.tree.leaves(full_parts(opt, state)), jax.tree.leaves(full_parts(opt, whole))
    ):
        np.testing.assert_array_equal(got, want)
    if mode == "host":
        _, plain, plain_losses = run_awkward(stage, tx, None)
        assert losses == plain_losses
        for got, want in zip(
            jax.tree.leaves(full_parts(opt, state)), jax.tree.leaves(full_parts(opt, plain))
        ):
            np.testing.assert_array_equal(got, want)


def test_the_device_leaves_are_updated_outside_the_host_computations():
    """Adam splits per leaf: one ``compute_on`` host computation per offloaded leaf only."""
    opt, state, _ = run_awkward(3, "adam", jzero.Offload(optimizer="host", ratio=AWKWARD_RATIO))
    lowered = opt.train_step(awkward_loss, donate=False).lower(state, awkward_batches(1)[0])
    calls = [line for line in lowered.as_text().splitlines() if "call @update" in line]
    offloaded = [s.memory_kind == HOST for s in state.plan.master]
    assert 0 < len(calls) == sum(offloaded) < len(state.plan.params)


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.5, True, "half", None])
def test_a_ratio_outside_zero_to_one_is_refused_with_the_fix(ratio):
    with pytest.raises(ValueError, match=r"Offload\.ratio must be a number in \(0, 1\]"):
        jzero.Offload(optimizer="host", ratio=ratio)


def test_a_split_far_from_the_ratio_is_warned_with_the_leaves():
    opt = _opt("adam", jzero.Offload(optimizer="host", ratio=0.5))
    with pytest.warns(UserWarning, match=r"keeps the optimizer state of 0\.81 of this model's "):
        opt.init(awkward_params())  # emb holds 0.79 of the parameters


def test_a_ratio_without_an_offloaded_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"optimizer=None offloads none of it; pass optimizer="):
        jzero.Offload(ratio=0.5)
    with pytest.raises(ValueError, match=r"optimizer=None offloads none of it"):
        jzero.Offload(params=True, ratio=0.5)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_the_estimate_splits_the_state_as_the_live_one_rests(ratio):
    """bf16 Adam at stage 3, eight equal leaves: the estimate's host bytes are the live
    state's on the host (+ Adam's int32 count), its optimizer bytes the rest on the device."""
    opt = _opt("adam", jzero.Offload(optimizer="host", ratio=ratio), stage=3)
    state = opt.init(_layers())
    psi = LAYERS * WIDTH * WIDTH
    est = jzero.estimate(
        params=psi, devices=8, stage=3, offload="host", offload_ratio=ratio,
        largest_layer_params=WIDTH * WIDTH,
    )  # fmt: skip
    live: dict[str, int] = {}
    for x in jax.tree.leaves((state.opt_state, state.master)):
        kind = x.sharding.memory_kind
        live[kind] = live.get(kind, 0) + x.addressable_data(0).nbytes
    count = 4  # Adam's step count, int32, on every device (with the host's share)
    assert live.get(HOST, 0) == est.host_bytes + count
    assert live.get("device", 0) == est.optimizer_bytes


def test_the_estimate_refuses_a_ratio_without_offload():
    with pytest.raises(ValueError, match=r"offload=None offloads none; pass offload='host'"):
        jzero.estimate(params=1e6, devices=8, stage=2, offload_ratio=0.5)
    with pytest.raises(ValueError, match=r"offload_ratio must be a number in \(0, 1\]"):
        jzero.estimate(params=1e6, devices=8, stage=2, offload="host", offload_ratio=0)
