"""The GPT example under jzero: every stage matches plain single-device Optax; the script runs."""

import contextlib
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import _models
import jax
import numpy as np
import pytest
from _paths import EXAMPLES, REPO

import jzero

sys.path.insert(0, str(EXAMPLES))
import data  # noqa: E402
import gpt  # noqa: E402
import progress  # noqa: E402
import train_lm  # noqa: E402

# d_model 36 and 3 heads: with min_shard_size=1 most leaves do not divide 8 and are padded,
# inside the nn.scan over layers too.
CFG = gpt.GPTConfig(seq_len=16, d_model=36, n_heads=3, n_layers=2)
STEPS = 3
# fp32 transformer (softmax, LayerNorm, GELU): the sharded run sums the batch and the
# gathered/reduce-scattered gradients in another order than one device does, so results
# agree to float32 rounding, amplified a little over 3 Adam steps. Adam's update
# lr * g / (|g| + eps) moves by up to lr / eps times a change in g (the most at g = 0), so
# eps bounds how far it amplifies rounding noise in a gradient that cancels to near zero
# (docs/design.md, "Traps"). Measured on the corpus's first batch: mlp_out[0, 94, 26]'s
# gradient is 7.12e-7, the sum of 8 per-device parts of about 5e-3, and moves by 1.8e-9
# with the summation order; eps 1e-6 (lr / eps = 3e3) made that a 1.8e-6 difference in the
# weight, past ATOL. With eps 1e-4 (lr / eps = 30) the same noise moves a weight by about
# 5e-8 per step: the comparison measures jzero, not that noise. Gradients well above 1e-4
# (the median here is 2e-3) still get Adam's normalised update.
RTOL, ATOL = 1e-5, 1e-6


def make_tx():
    return _models.make_tx(3e-3, eps=1e-4, weight_decay=0.1)


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


# A tiny configuration of the main job: about 15 s per run on 2 unloaded CPU cores.
TINY = [
    *("--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16"),
    *("--batch-size", "8", "--lr", "1e-2", "--sample-tokens", "8"),
]


@pytest.mark.smoke  # the README's main job, end to end (tiny)
def test_train_lm_script_runs(tmp_path, capsys):
    argv = [*TINY, "--steps", "30", "--eval-every", "10", "--out", str(tmp_path)]
    with standard():  # Optax's Adam is not strict-promotion clean (see `standard`)
        assert train_lm.main(argv) == 0
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"loss fell from (\S+) to (\S+)", out).groups())
    assert last < first
    assert (
        "data: the King James Bible, 3,889,040 bytes to train on, 415,207 held out (0.1 of "
        "the chapters, whole), scored on 128 windows of 16 bytes every 10 steps\n"
    ) in out
    val = re.search(
        r"^validation loss fell from (\S+) to (\S+) \(held-out chapters\); "
        r"lowest (\S+) after (\d+) steps; final/lowest (\S+)$",
        out,
        re.M,
    )
    val_first, val_last, val_best, best_step, ratio = map(float, val.groups())
    assert val_last < val_first and val_best <= val_last
    assert ratio == round(val_last / val_best, 3)
    # The default output is the summary: no per-leaf layout, no per-collective table.
    assert "leaves sharded" not in out and "all-gather" not in out
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

    # summary.json: the same figures, exact, for tools and docs.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_losses"] == [[s, pytest.approx(v, abs=5e-5)] for s, v in evals]
    vals = [v for _, v in summary["val_losses"]]
    assert summary["val_loss_final"] == vals[-1] and summary["val_loss_min"] == min(vals)
    assert summary["val_loss_min_step"] == best_step
    assert summary["val_final_over_min"] == vals[-1] / min(vals)
    assert (summary["stage"], summary["devices"], summary["steps"]) == (3, 8, 30)
    cfg = gpt.GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    model = {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16, "dtype": "float32"}
    assert summary["model"] == model
    shapes = jax.eval_shape(functools.partial(gpt.init_params, cfg, jax.random.key(0)))
    assert summary["params"] == gpt.count_params(shapes)
    assert (summary["train_bytes"], summary["val_bytes"]) == (3_889_040, 415_207)
    assert summary["val_windows"] == 128 and summary["tokens_per_step"] == 8 * 16
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0 and summary["cpu_s"] > 0
    assert summary["load_average"] is None or len(summary["load_average"]) == 3
    sample = summary["sample"]
    assert sample["prompt"] == "And God said" and sample["text"].startswith("And God said")
    assert len(sample["text"].encode()) == len("And God said") + 8
    assert sample["text"] in out
    # The shared span: the prompt at least (it is in the training text), and exactly what
    # the brute-force search finds.
    train, _ = data.split(data.load_corpus(), 0.1)
    text = sample["text"].encode()
    assert sample["shared_span_text"].encode() in train.tobytes()
    assert sample["shared_span_bytes"] == len(sample["shared_span_text"].encode()) >= 12
    n = sample["shared_span_bytes"]
    longer = [text[i : i + n + 1] for i in range(len(text) - n)]  # every span 1 byte longer
    assert not any(piece in train.tobytes() for piece in longer)
    assert len(sample["held_out_shared_span_bytes"]) == 5
    line = f"longest span shared with the training text: {sample['shared_span_bytes']} bytes"
    assert line in out


def test_train_lm_trains_with_muon(tmp_path, capsys):
    """--optimizer muon: Newton-Schulz on the blocks' kernels, each updated whole (in a
    stack of its shape's leaves) at stage 3, AdamW on the rest; validation loss falls."""
    argv = [*TINY, "--steps", "30", "--eval-every", "15", "--optimizer", "muon"]
    with standard():
        assert train_lm.main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^validation loss fell from (\S+) to (\S+)", out, re.M), out
    args = train_lm.make_parser().parse_args(argv)
    cfg = gpt.GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    opt, _ = train_lm.make_optimizer(args, jzero.data_mesh(), cfg=cfg)
    shapes = jax.eval_shape(functools.partial(gpt.init_params, cfg, jax.random.key(0)))
    rows = opt.plan(shapes).describe().splitlines()
    kernels = [row for row in rows if "['blocks']" in row and "['kernel']" in row]
    assert len(kernels) == 4 and all("whole 1,2 on every device" in row for row in kernels), rows


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
    assert progress.trend("loss", first, last) == line


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
            ["--val-fraction", "0.001", "--seq-len", "5000"],  # holds out John 3 only
            "--seq-len 5000 needs windows of 5001 bytes, but --val-fraction 0.001 splits the "
            "4,304,247-byte text into 4,300,071 training and 4,176 held-out bytes; lower "
            "--seq-len or change --val-fraction",
        ),
        (
            ["--val-fraction", "0.0005"],
            "--val-fraction 0.0005 holds out none of the 1,189 chapters; use at least "
            "1/1189 = 0.00084",
        ),
        (["--steps", "0"], "argument --steps: 0 is not a positive integer"),
        (["--resume"], "--resume needs --checkpoint-dir DIR, the directory to resume from"),
        (
            ["--save-every", "5"],
            "--save-every needs --checkpoint-dir DIR, where the checkpoints go",
        ),
        (["--save-every", "0"], "argument --save-every: 0 is not a positive integer"),
        (
            ["--stage", "0", "--offload"],
            "--offload needs --stage 1, 2 or 3: at stage 0 every device holds the whole "
            "optimizer state",
        ),
        (
            ["--stage", "2", "--offload-params"],
            "--offload-params needs --stage 3: at stage 2 every device holds the whole "
            "parameters, and only stage 3's shards can rest in host memory",
        ),
        (
            ["--stage", "0", "--grad-quant", "int4"],
            "--grad-quant int4 needs --stage 1, 2 or 3: it quantizes their gradient "
            "reduce-scatter, and stage 0 all-reduces",
        ),
        (["--stage", "4"], "argument --stage: '4' is not 0, 1, 2, 3 or auto"),
        (["--stage", "auto", "--offload"], "--stage auto chooses offload itself; drop --offload"),
        (
            ["--stage", "auto", "--grad-accum", "2"],
            "--stage auto chooses grad-accum itself; drop --grad-accum",
        ),
        (
            ["--stage", "2", "--device-budget", "1GB"],
            "--device-budget and --host-budget are for --stage auto",
        ),
    ],
)
def test_train_lm_refuses_bad_flags_up_front(tmp_path, capsys, args, error):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.main([*args, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2  # argparse's usage error: one line, no traceback
    assert capsys.readouterr().err.splitlines()[-1].endswith(f" error: {error}")
    assert not (tmp_path / "run").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("flags", "offload", "grad_quant"),
    [
        ([], jzero.Offload(), None),
        (["--offload"], jzero.Offload(optimizer="stream"), None),
        (["--offload", "host"], jzero.Offload(optimizer="host"), None),
        (["--stage", "3", "--offload-params"], jzero.Offload(params=True), None),
        (
            ["--stage", "3", "--offload", "host", "--offload-params"],
            jzero.Offload(optimizer="host", params=True),
            None,
        ),
        (["--grad-quant", "int4", "--precision", "bf16"], jzero.Offload(), "int4"),
        (
            ["--stage", "1", "--offload", "--grad-quant", "int8"],
            jzero.Offload(optimizer="stream"),
            "int8",
        ),
    ],
)
def test_train_lm_flags_build_the_optimizer(flags, offload, grad_quant):
    args = train_lm.make_parser().parse_args(flags)
    opt, _ = train_lm.make_optimizer(args, jzero.data_mesh())
    assert (opt.stage, opt.offload) == (args.stage, offload)
    precision = train_lm.PRECISIONS[args.precision]
    assert opt.precision == precision and opt.comm == jzero.Communication(grad_quant=grad_quant)


def test_train_lm_stage_auto_trains_with_the_configuration_it_chose(tmp_path, capsys):
    """``--stage auto``: the search's table is printed, and the run is the chosen
    configuration (its stage and accumulation), within the budget."""
    argv = [*TINY, "--stage", "auto", "--device-budget", "400KB", "--steps", "2"]
    with standard():
        assert train_lm.main([*argv, "--eval-every", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"^chosen: (zero(\d)[a-z ]* accum=\d+) \(compiled peak (\S+) MB", out, re.M)
    name, stage, peak = chosen[1], int(chosen[2]), float(chosen[3])
    assert peak <= 0.4 and re.search(rf"^{name} .*<- chosen$", out, re.M)
    assert f"\nstage {stage} on 8 devices" in out
    assert "<- chosen" in out


@pytest.mark.parametrize(
    ("flags", "params_where"),
    [
        (["--stage", "2", "--offload"], ""),
        (["--stage", "3", "--offload", "host", "--offload-params"], " in pinned host memory"),
    ],
)
def test_train_lm_script_runs_with_the_optimizer_offloaded(flags, params_where, tmp_path, capsys):
    steps = 3
    argv = [*TINY, *flags, "--steps", str(steps), "--eval-every", "3"]
    argv += ["--verbose"]  # the layout and jzero.report
    with standard():
        assert train_lm.main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    layout = re.search(
        r"^stage \d on 8 devices: .* per device(.*); optimizer state .* per device(.*)$", out, re.M
    )
    assert layout.groups() == (params_where, " in pinned host memory")
    # jzero.report: every byte of the optimizer state is in host memory (and of the
    # parameters, with --offload-params).
    for state in ("optimizer state", "params") if params_where else ("optimizer state",):
        row = re.search(rf"^{state} +([\d,]+)\n  in pinned_host +([\d,]+)$", out, re.M)
        assert row.group(1) == row.group(2), state
    log = (tmp_path / "train.log").read_text()
    assert f"'offload': '{flags[3] if len(flags) > 3 else 'stream'}'" in log
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", log)]
    assert len(losses) == steps and all(np.isfinite(losses))


# ------------------------------------------------------------------ checkpoints and resume
# N steps straight through, and the same run stopped part-way (the checkpoint at N/2, a few
# steps after it lost) then resumed with --resume: --steps is N in both invocations, as it
# sets the learning-rate schedule too.
N, SAVE_EVERY, LOST = 20, 10, 3
RESUME = [*TINY, "--steps", str(N), "--eval-every", "5", "--save-every", str(SAVE_EVERY)]
# Runs that sum in another order (another stage, two processes) are compared with this one
# over its N steps at rtol 1e-5. That holds on any CPU because N steps of this run are not
# chaotic: on its single-device equivalent (same model, data, clipped AdamW and schedule),
# Gaussian noise of 16x fp32's rounding (2^-20 of each gradient leaf's RMS) added to every
# gradient element at every step moved the N losses by at most 1.6e-7 relative over 8
# seeds, and 256x (2^-16) by at most 6.4e-7, so 1e-5 is 15x the latter (scripts/
# sensitivity.py --steps 20 --batch 8 --schedule cosine --clip 1.0 --bits 20, and 16).
# 200 steps at lr 1e-2 are another matter (tests/_lm.py).


class Preempted(Exception):
    """Stands in for the job being killed."""


def run_main(argv):
    """``train_lm.main(argv)``'s stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), standard():
        assert train_lm.main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Directory with straight/{out,ckpt,stderr} (N steps, its stderr a file) and
    stopped/{out,ckpt} (stopped after N/2 + LOST steps; its newest checkpoint at N/2), and
    that checkpoint copied to other/."""
    root = tmp_path_factory.mktemp("runs")
    (root / "straight").mkdir()
    with open(root / "straight/stderr", "w") as err, contextlib.redirect_stderr(err):
        run_main(
            [
                *RESUME,
                "--out",
                str(root / "straight/out"),
                "--checkpoint-dir",
                str(root / "straight/ckpt"),
            ]
        )

    real = data.batches

    def preempted(*args, **kwargs):  # the job dies while drawing batch N/2 + LOST + 1
        it = real(*args, **kwargs)
        for _ in range(SAVE_EVERY + LOST):
            yield next(it)
        raise Preempted

    stopped = ["--out", str(root / "stopped/out"), "--checkpoint-dir", str(root / "stopped/ckpt")]
    with pytest.MonkeyPatch.context() as mp, pytest.raises(Preempted), standard():
        mp.setattr(data, "batches", preempted)
        train_lm.main([*RESUME, *stopped])
    assert jzero.Checkpointer(root / "stopped/ckpt").all_steps() == [SAVE_EVERY]
    shutil.copytree(root / "stopped/ckpt", root / "other/ckpt")
    return root


def saved(directory, step):
    """Checkpoint ``step``'s ``extra`` and all its arrays (true shapes, on one device)."""
    ckpt = jzero.Checkpointer(directory)
    meta = ckpt.metadata(step)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("one",))  # jax 0.12.1 deprecates
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # SingleDevice...
    targets = {
        name: jax.ShapeDtypeStruct(tuple(leaf["shape"]), leaf["dtype"], sharding=one)
        for name, leaf in meta["leaves"].items()
    }
    arrays = {name: np.asarray(x) for name, x in ckpt.read(step, targets).items()}
    ckpt.close()
    return meta["extra"], arrays


def logged(out):
    """train.log's record of the run: steps, evaluations, summary and sample, without the
    timestamps and timings."""
    lines = [line.split(" ", 2)[2] for line in (out / "train.log").read_text().splitlines()]
    keep = ("step ", "validation loss ", "loss ", "sample ")
    return [re.sub(r" step_s .*", "", line) for line in lines if line.startswith(keep)]


def test_resumed_run_equals_the_uninterrupted_one_bitwise(runs):
    out = run_main(
        [
            *RESUME,
            "--resume",
            "--out",
            str(runs / "stopped/out"),
            "--checkpoint-dir",
            str(runs / "stopped/ckpt"),
        ]
    )
    assert (
        f"resumed from checkpoint step {SAVE_EVERY} in {runs / 'stopped/ckpt'} (saved at stage 3 "
        f"on 8 devices, now stage 3 on 8), continuing to step {N}\n"
    ) in out
    assert "note:" not in out
    # The final checkpoints: the whole state (weights, Adam moments, step) bit for bit, and
    # the loss curves in `extra` as exact floats; only the step timings differ.
    want_extra, want_arrays = saved(runs / "straight/ckpt", N)
    got_extra, got_arrays = saved(runs / "stopped/ckpt", N)
    assert sorted(got_arrays) == sorted(want_arrays)
    for name, want in want_arrays.items():
        np.testing.assert_array_equal(got_arrays[name], want, err_msg=name)
    assert len(got_extra.pop("step_seconds")) == len(want_extra.pop("step_seconds")) == N
    assert got_extra == want_extra
    assert got_extra["step"] == got_extra["batches_drawn"] == N
    assert [s for s, _ in got_extra["val_losses"]] == [0, 5, 10, 15, 20]
    # train.log and stdout: the resumed run logs the whole run, as the straight one does.
    want_log, got_log = logged(runs / "straight/out"), logged(runs / "stopped/out")
    assert got_log == want_log
    assert len([line for line in got_log if line.startswith("step ")]) == N
    summary = [line for line in out.splitlines() if line.startswith(("loss ", "validation loss "))]
    assert len(summary) == 2 and all(line in want_log for line in summary)
    assert (runs / "stopped/out/loss.png").stat().st_size > 0


def test_train_lm_redraws_its_bar_once_a_minute_off_a_terminal(runs):
    """With stderr a file, each redraw of the bar is a line of the log: the first, one per
    full minute at most (tqdm's mininterval), and the last; not one per step."""
    stderr = (runs / "straight/stderr").read_bytes().decode()  # read_text() turns \r to \n
    draws = stderr.split("\r")[1:]  # tqdm starts each draw with \r
    wall_s = json.loads((runs / "straight/out/summary.json").read_text())["wall_s"]
    assert 2 <= len(draws) <= 2 + wall_s // 60, draws
    assert draws[0].startswith("zero3:   0%|") and f" 0/{N} " in draws[0]
    last = draws[-1].split("\n")[0]  # the final step's figures, drawn by close()
    assert last.startswith("zero3: 100%|") and f" {N}/{N} " in last and "loss=" in last


# Flipping bytes in a data file makes Orbax abandon reads whose callbacks die later with
# "Event loop is closed" (harmless; see tests/checkpoint/test_checkpoint.py).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_at_another_stage_skipping_a_corrupt_checkpoint(runs):
    ckpt_dir = runs / "other/ckpt"
    # A newer checkpoint, corrupt: a copy of step N/2 with bytes flipped in its largest file.
    shutil.copytree(ckpt_dir / str(SAVE_EVERY), ckpt_dir / "15")
    files = [Path(root) / f for root, _, names in os.walk(ckpt_dir / "15/state") for f in names]
    largest = max((f for f in files if f.parent.name == "d"), key=lambda f: f.stat().st_size)
    with open(largest, "r+b") as f:
        f.seek(largest.stat().st_size // 2)
        chunk = f.read(8)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))

    out = run_main(
        [
            *RESUME,
            "--resume",
            "--stage",
            "1",
            "--out",
            str(runs / "other/out"),
            "--checkpoint-dir",
            str(ckpt_dir),
        ]
    )
    line = next(line for line in out.splitlines() if line.startswith("resumed"))
    assert line.startswith(
        f"resumed from checkpoint step {SAVE_EVERY} in {ckpt_dir} (saved at stage 3 on 8 "
        f"devices, now stage 1 on 8), continuing to step {N}; skipped invalid step 15: "
        "checkpoint step 15: "
    )
    # Resharded to stage 1: the same state, but stage 1 may sum in another order than stage
    # 3, so only float32-rounding agreement is promised (on CPU it is even bit for bit),
    # which 10 steps of this run do not amplify past 1e-5 (see RESUME).
    want, _ = saved(runs / "straight/ckpt", N)
    got, _ = saved(ckpt_dir, N)
    assert got["losses"][:SAVE_EVERY] == want["losses"][:SAVE_EVERY]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(
        [v for _, v in got["val_losses"]], [v for _, v in want["val_losses"]], rtol=1e-5
    )


def test_train_lm_refuses_checkpoint_dir_mixups(runs, tmp_path, capsys):
    def error(*args):
        with pytest.raises(SystemExit) as exit_info:
            train_lm.main([*TINY, *args, "--out", str(tmp_path / "run")])
        assert exit_info.value.code == 2
        return capsys.readouterr().err.splitlines()[-1].split(" error: ", 1)[1]

    empty = tmp_path / "empty"
    assert error("--checkpoint-dir", str(empty), "--resume") == (
        f"--resume: no checkpoint in {empty}; leave out --resume to start a new run there"
    )
    done = runs / "straight/ckpt"
    assert error("--checkpoint-dir", str(done)) == (
        f"--checkpoint-dir {done} already holds checkpoints (the newest at step {N}); add "
        "--resume to continue that run, or use an empty directory"
    )
    (tmp_path / "file").write_text("")
    assert error("--checkpoint-dir", str(tmp_path / "file")) == (
        f"--checkpoint-dir {tmp_path / 'file'} is a file, not a directory"
    )
    assert not empty.exists() and not (tmp_path / "run").exists()  # refused before anything ran
    assert error("--checkpoint-dir", str(done), "--resume", "--steps", "5") == (
        f"--steps 5 is the total, but the checkpoint is at step {N} already; "
        f"pass --steps {N} or more"
    )


# ------------------------------------------------------------------ several processes
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?|nan|inf")


def launch_local(n, argv, timeout):
    """``bash scripts/launch_local.sh n python examples/train_lm.py *argv`` (the launcher
    sets JZERO_*): (exit status, stdout, stderr, seconds). Past ``timeout`` the whole
    process group (launcher and its processes) is killed and the test fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JZERO_")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = ["bash", str(REPO / "scripts/launch_local.sh"), str(n), sys.executable]
    start = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, str(REPO / "examples/train_lm.py"), *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to kill on timeout
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{n} processes still running after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - start


def numbers_and_text(lines):
    """(every number in ``lines``, the lines with each number replaced by '#')."""
    nums = [float(x) for line in lines for x in NUMBER.findall(line)]
    return nums, [NUMBER.sub("#", line) for line in lines]


@pytest.mark.slow  # real processes: in CI (-m ''), not in the quick default run
def test_train_lm_on_two_processes_trains_like_one(runs, tmp_path):
    """The resume tests' straight run (1 process x 8 CPU devices) again as 2 processes x 4
    through scripts/launch_local.sh: the same global batches, each process placing its rows,
    so the same run up to float32 rounding (the gradient sums go through gloo instead),
    which N steps of this run do not amplify past 1e-5 (see RESUME)."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    argv = [*RESUME, "--out", str(out), "--checkpoint-dir", str(ckpt), "--timeout", "120"]
    status, stdout, stderr, seconds = launch_local(2, argv, timeout=400)
    assert status == 0, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    print(f"2 processes: {seconds:.1f} s from launch to exit")

    # Process 0 alone prints and writes: one of each line, one train.log and loss.png.
    assert stdout.count("stage 3 on 8 devices (8 x cpu, 2 processes x 4): GPT ") == 1
    wrote = f"wrote {out / 'train.log'}, {out / 'loss.png'}, {out / 'summary.json'}\n"
    assert stdout.count(wrote) == 1
    assert stdout.count(f"checkpoints: steps [{SAVE_EVERY}, {N}] in {ckpt}\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "summary.json", "train.log"]
    assert (out / "loss.png").stat().st_size > 0

    # The exact curve (the final checkpoint's `extra`, written by both processes): the
    # losses, gradient norms and validation losses to float32 rounding; the rest exactly.
    want, _ = saved(runs / "straight/ckpt", N)
    got, _ = saved(ckpt, N)
    for key in ("losses", "grad_norms"):
        np.testing.assert_allclose(got.pop(key), want.pop(key), rtol=1e-5, err_msg=key)
    got_val, want_val = got.pop("val_losses"), want.pop("val_losses")
    assert [s for s, _ in got_val] == [s for s, _ in want_val] == [0, 5, 10, 15, 20]
    np.testing.assert_allclose([v for _, v in got_val], [v for _, v in want_val], rtol=1e-5)
    assert len(got.pop("step_seconds")) == len(want.pop("step_seconds")) == N
    assert got == want  # step, data position, learning rates, flags

    # train.log (steps, evaluations, summary and sample, without timings): the same lines
    # but for their numbers, which agree to their printed precision (losses and norms have 4
    # decimals: atol 1e-4 is one unit of the last digit, which fp32 rounding may flip).
    got_nums, got_text = numbers_and_text(logged(out))
    want_nums, want_text = numbers_and_text(logged(runs / "straight/out"))
    assert got_text == want_text
    assert len([line for line in got_text if line.startswith("step ")]) == N
    np.testing.assert_allclose(got_nums, want_nums, rtol=1e-5, atol=1e-4)
