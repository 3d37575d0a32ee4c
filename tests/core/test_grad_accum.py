"""Gradient accumulation over k micro-batches equals one step on the concatenated batch."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params

import jzero

# fp32; accumulation adds k partial means instead of one mean: float rounding only.
RTOL, ATOL = 1e-6, 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulated_step_equals_one_big_step(stage):
    params, batches = awkward_params(), awkward_batches(3, batch_size=32)
    results = []
    for k in (1, 4):
        opt = jzero.ZeroOptimizer(
            optax.adam(1e-2), jzero.data_mesh(), stage=stage, min_shard_size=1
        )
        state = opt.init(params)
        step = opt.train_step(awkward_loss, grad_accum=k)
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        results.append((losses, opt.full_params(state)))
    (l1, p1), (l4, p4) = results
    np.testing.assert_allclose(l4, l1, rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_batch_that_does_not_split_into_micro_batches():
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=2)
    state = opt.init(awkward_params())
    batch = awkward_batches(1, batch_size=16)[0]
    with pytest.raises(ValueError, match="do not split into 4 micro-batches.*multiple of 32"):
        opt.train_step(awkward_loss, grad_accum=4)(state, batch)
    with pytest.raises(ValueError, match="grad_accum must be a positive int"):
        opt.train_step(awkward_loss, grad_accum=0)
