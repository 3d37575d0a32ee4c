"""The compiled step of each stage contains the collectives that stage calls for, and no others."""

from __future__ import annotations

import optax
import pytest
from _models import stacked_batch, stacked_loss, stacked_params

import jzero
from jzero.accounting import collectives

LAYERS, WIDTH = 4, 64


def _collectives(stage):
    opt = jzero.ZeroOptimizer(optax.sgd(1e-2), jzero.data_mesh(), stage=stage, min_shard_size=1)
    state = opt.init(stacked_params(LAYERS, WIDTH))
    step = opt.train_step(stacked_loss, manual_gather=True)
    hlo = step.lower(state, stacked_batch(WIDTH)).compile().as_text()
    # Scalar all-reduces (the loss mean, the gradient norm) are bookkeeping, not model data.
    return [c for c in collectives(hlo) if c.shape != ()]


def _kinds(cs):
    return sorted({c.kind for c in cs})


W_FULL, W_SHARD = (WIDTH, WIDTH), (WIDTH // 8, WIDTH)  # sharded on its major dim


def test_stage0_all_reduces_full_gradients_only():
    cs = _collectives(0)
    assert _kinds(cs) == ["all-reduce"]
    assert sorted(c.shape for c in cs) == [(LAYERS, WIDTH), (LAYERS, WIDTH, WIDTH)]


def test_stage1_reduce_scatters_after_backward_and_gathers_params():
    cs = _collectives(1)
    assert _kinds(cs) == ["all-gather", "reduce-scatter"]
    # Once per step, outside any loop: the whole stacked gradient, after backward.
    rs = [c for c in cs if c.kind == "reduce-scatter"]
    assert all(c.trip_count == 1 for c in rs)
    assert sorted(c.shape for c in rs) == [(LAYERS, WIDTH // 8), (LAYERS, WIDTH // 8, WIDTH)]
    _gathers_the_update(cs)


def _gathers_the_update(cs):
    """Stages 1-2 gather the updated parameters after the step: the stacked weight one
    layer at a time (a loop of LAYERS trips, so no whole second copy in another layout),
    the stacked bias whole."""
    ag = sorted((c.shape, c.trip_count) for c in cs if c.kind == "all-gather")
    assert ag == [((LAYERS, WIDTH), 1), (W_FULL, LAYERS)], ag


def test_stage2_reduce_scatters_each_layer_inside_backward():
    cs = _collectives(2)
    assert _kinds(cs) == ["all-gather", "reduce-scatter"]  # no full-size all-reduce
    rs = [c for c in cs if c.kind == "reduce-scatter"]
    # Inside the backward scan: one layer's gradient at a time, LAYERS times.
    assert sorted(c.shape for c in rs) == [(WIDTH // 8,), W_SHARD]
    assert all(c.trip_count == LAYERS for c in rs)
    _gathers_the_update(cs)  # the parameter update, after the step


def test_stage3_gathers_in_forward_and_again_in_backward():
    cs = _collectives(3)
    assert _kinds(cs) == ["all-gather", "reduce-scatter"]
    weight_gathers = [c for c in cs if c.kind == "all-gather" and c.shape == W_FULL]
    # One per layer in the forward loop, and again in the backward loop (re-gathered,
    # not kept alive): two different loop bodies, each LAYERS trips.
    assert len({c.computation for c in weight_gathers}) == 2
    assert all(c.trip_count == LAYERS for c in weight_gathers)
    rs = [c for c in cs if c.kind == "reduce-scatter"]
    assert sorted(c.shape for c in rs) == [(WIDTH // 8,), W_SHARD]
    assert all(c.trip_count == LAYERS for c in rs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_gradient_all_reduce_in_sharded_stages(stage):
    assert not [c for c in _collectives(stage) if c.kind == "all-reduce"]
