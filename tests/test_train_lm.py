"""The GPT example under jzero: every stage matches plain single-device Optax; the script runs."""

import functools
import re
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jzero

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import data  # noqa: E402
import gpt  # noqa: E402
import train_lm  # noqa: E402

# d_model 36 and 3 heads: with min_shard_size=1 most leaves do not divide 8 and are padded,
# inside the nn.scan over layers too.
CFG = gpt.GPTConfig(seq_len=16, d_model=36, n_heads=3, n_layers=2)
STEPS = 3
# fp32 transformer (softmax, LayerNorm, GELU): the sharded run sums the batch and the
# gathered/reduce-scattered gradients in another order than one device does, so results
# agree to float32 rounding, amplified a little over 3 Adam steps. eps=1e-6 keeps Adam from
# turning rounding noise in near-zero gradients into +-lr updates (docs/design.md, "Traps").
RTOL, ATOL = 1e-5, 1e-6


def make_tx():
    return optax.adamw(3e-3, eps=1e-6, weight_decay=0.1)


def strict(loss_fn):
    """Traces ``loss_fn`` under strict dtype promotion even when the caller relaxes it."""

    def wrapped(params, batch):
        with jax.numpy_dtype_promotion("strict"):
            return loss_fn(params, batch)

    return wrapped


# Optax's Adam computes its bias correction as `decay ** count` (python float ** int32),
# which strict promotion rejects, so the optimizer runs under standard promotion while
# the model itself stays strict (see `strict`).
standard = functools.partial(jax.numpy_dtype_promotion, "standard")


def batches(n):
    it = data.batches(data.load_corpus(), batch_size=16, seq_len=CFG.seq_len, seed=0)
    return [next(it) for _ in range(n)]


@functools.cache
def reference():
    """Plain Optax on one device: (initial params, loss_fn, batches, final params, losses)."""
    init_fn = functools.partial(gpt.init_params, CFG, jax.random.key(0))
    loss_fn = strict(gpt.make_loss_fn(CFG))
    batch_list = batches(STEPS)
    params = jax.jit(init_fn)()
    tx = make_tx()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    with standard():
        for batch in batch_list:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
    return init_fn, loss_fn, batch_list, params, losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_matches_single_device_optax(stage):
    init_fn, loss_fn, batch_list, ref_params, ref_losses = reference()

    opt = jzero.ZeroOptimizer(make_tx(), jzero.data_mesh(), stage=stage, min_shard_size=1)
    with standard():
        state = opt.init(init_fn=init_fn)
    if stage == 3:  # the embedding really is partitioned: d_model 36 padded to 40, over 8
        emb = state.params["tok_embed"]["embedding"]
        assert emb.addressable_shards[0].data.shape == (256, 40 // 8)
    step = opt.train_step(loss_fn, manual_gather=True)
    losses = []
    with standard():
        for batch in batch_list:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))

    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    got = opt.full_params(state)
    for (path, want), leaf in zip(
        jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(got), strict=True
    ):
        assert leaf.shape == want.shape, path
        np.testing.assert_allclose(leaf, want, rtol=RTOL, atol=ATOL, err_msg=str(path))


def test_train_lm_script_runs(tmp_path, capsys):
    argv = [
        *("--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16"),
        *("--steps", "30", "--batch-size", "8", "--lr", "1e-2", "--sample-tokens", "8"),
        *("--out", str(tmp_path)),
    ]
    with standard():  # Optax's Adam is not strict-promotion clean (see `standard`)
        assert train_lm.main(argv) == 0
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"loss fell from (\S+) to (\S+)", out).groups())
    assert last < first
    assert (tmp_path / "loss.png").stat().st_size > 0
    log = (tmp_path / "train.log").read_text()
    assert len(re.findall(r"step \d+ loss", log)) == 30
