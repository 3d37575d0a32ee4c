"""The GPT example under jzero: every stage matches plain single-device Optax; the script runs."""

import functools
import re
import sys
from pathlib import Path

import _models
import jax
import numpy as np
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
    return _models.make_tx(3e-3, eps=1e-6, weight_decay=0.1)


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
def gpt_reference():
    """Plain Optax on one device: (initial params, loss_fn, batches, final params, losses)."""
    init_fn = functools.partial(gpt.init_params, CFG, jax.random.key(0))
    loss_fn = strict(gpt.make_loss_fn(CFG))
    batch_list = batches(STEPS)
    with standard():
        ref = _models.reference(make_tx(), jax.jit(init_fn)(), loss_fn, batch_list)
    return init_fn, loss_fn, batch_list, ref.params, ref.losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_matches_single_device_optax(stage):
    init_fn, loss_fn, batch_list, ref_params, ref_losses = gpt_reference()

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
        *("--eval-every", "10", "--out", str(tmp_path)),
    ]
    with standard():  # Optax's Adam is not strict-promotion clean (see `standard`)
        assert train_lm.main(argv) == 0
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"loss fell from (\S+) to (\S+)", out).groups())
    assert last < first
    assert "data: 5,616 bytes train, 624 held out (last 10%, 38 windows of 16 targets)" in out
    val = re.search(
        r"^validation loss fell from (\S+) to (\S+) \(held-out text\); "
        r"lowest (\S+) after (\d+) steps$",
        out,
        re.M,
    )
    val_first, val_last, val_best, best_step = map(float, val.groups())
    assert val_last < val_first and val_best <= val_last
    assert (tmp_path / "loss.png").stat().st_size > 0
    log = (tmp_path / "train.log").read_text()
    assert len(re.findall(r"step \d+ loss", log)) == 30
    evals = [
        (int(steps), float(loss))
        for loss, steps in re.findall(r"validation loss (\S+) after (\d+) steps\n", log)
    ]
    assert [steps for steps, _ in evals] == [0, 10, 20, 30]
    assert (evals[0][1], evals[-1][1]) == (val_first, val_last)
    assert min(evals, key=lambda sv: sv[1]) == (best_step, val_best)


@pytest.mark.parametrize(
    ("first", "last", "line"),
    [
        (5.5927, 2.5, "loss fell from 5.5927 to 2.5000"),
        (5.5927, 3575.08, "loss rose from 5.5927 to 3575.0800"),  # e.g. --lr 30
        (5.5927, 5.5927, "loss stayed at 5.5927"),
        (5.5927, float("nan"), "loss went from 5.5927 to nan"),
    ],
)
def test_trend_says_what_happened(first, last, line):
    assert train_lm.trend("loss", first, last) == line


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--batch-size", "12"],
            "--batch-size 12 does not split over 8 devices × 1 micro-batch; use a multiple of 8",
        ),
        (
            ["--batch-size", "16", "--grad-accum", "4"],
            "--batch-size 16 does not split over 8 devices × 4 micro-batches; use a multiple of 32",
        ),
        (["--val-fraction", "0"], "--val-fraction 0.0 is not between 0 and 1 (default 0.1)"),
        (
            ["--seq-len", "700"],
            "--seq-len 700 needs windows of 701 bytes, but --val-fraction 0.1 splits the "
            "6,240-byte text into 5,616 training and 624 held-out bytes; lower --seq-len or "
            "change --val-fraction",
        ),
        (["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    ],
)
def test_train_lm_refuses_bad_flags_up_front(tmp_path, capsys, args, error):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main([*args, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2  # argparse's usage error: one line, no traceback
    assert capsys.readouterr().err.splitlines()[-1].endswith(f" error: {error}")
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_validation_text_is_held_out_and_tiled_once():
    corpus = data.load_corpus()
    train, val = data.split(corpus, 0.1)
    assert (len(train), len(val)) == (5616, 624)
    assert np.array_equal(np.concatenate([train, val]), corpus)  # the last 10%, no overlap
    windows = data.eval_windows(val, seq_len=16, multiple_of=8)
    tokens, weight = windows["tokens"], windows["weight"]
    # (624 - 1) // 16 = 38 windows, padded to 40; each window's last byte starts the next.
    assert tokens.shape == (40, 17) and tokens.dtype == np.int32
    assert weight.tolist() == [1.0] * 38 + [0.0] * 2
    assert np.array_equal(tokens[:38, :-1].ravel(), val[: 38 * 16])
    assert np.array_equal(tokens[:38, 1:].ravel(), val[1 : 38 * 16 + 1])
    assert np.array_equal(tokens[38:], tokens[[0, 0]])
    with pytest.raises(ValueError, match="too few for one window"):
        data.eval_windows(val[:16], seq_len=16)
