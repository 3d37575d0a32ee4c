"""The example LM (examples/gpt.py) trained a few hundred steps on the shipped corpus, for
tests that compare a lossy option's final loss with the exact run's."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import numpy as np
import optax

import jzero

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import data  # noqa: E402
import gpt  # noqa: E402

LM = gpt.GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)
LM_STEPS, LM_LAST = 200, 20  # the final loss: the mean of the last LM_LAST steps' losses


@functools.cache
def lm_losses(tx: optax.GradientTransformation, precision: jzero.Precision) -> list[float]:
    """Every step's loss: stage 3 on the data mesh, every leaf sharded, seed 0."""
    opt = jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=3, precision=precision, min_shard_size=1)
    state = opt.init(init_fn=functools.partial(gpt.init_params, LM, jax.random.key(0)))
    step = opt.train_step(gpt.make_loss_fn(LM), manual_gather=True)
    batches = data.batches(data.load_corpus(), batch_size=16, seq_len=LM.seq_len, seed=0)
    losses = []
    for _ in range(LM_STEPS):
        state, metrics = step(state, next(batches))
        losses.append(float(metrics["loss"]))
    return losses


def final(losses: list[float]) -> float:
    """The mean of the last LM_LAST losses."""
    return float(np.mean(losses[-LM_LAST:]))
