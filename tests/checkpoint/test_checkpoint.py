"""Checkpoints: Orbax save/restore across stages, device counts and precisions; resume;
async saves with donation; integrity (checksums, missing/truncated files, killed saves)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params
from jax.sharding import PartitionSpec as P

import jzero
from jzero.checkpoint import Checkpointer, CheckpointError, CheckpointMismatchError

BF16 = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def make_opt(devices=8, stage=3, precision=None, mesh=None, **kw):
    mesh = jzero.data_mesh(jax.devices()[:devices]) if mesh is None else mesh
    return jzero.ZeroOptimizer(
        optax.adam(1e-2), mesh, stage=stage, min_shard_size=1, precision=precision, **kw
    )


def train(opt, state, batches):
    step = opt.train_step(awkward_loss)
    for batch in batches:
        state, _ = step(state, batch)
    return state


def weights(opt, state):
    """fp32 weights at true shapes: the master weights, else the params."""
    full = opt.full_state(state)
    return full.master if full.master is not None else full.params


def assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


# (devices, stage) saved -> (devices, stage) restored
MATRIX = [
    ((8, 3), (8, 3)),
    pytest.param((8, 3), (4, 1), marks=pytest.mark.smoke),  # stage 3 on 8 -> stage 1 on 4
    ((4, 1), (8, 3)),
    ((8, 2), (1, 0)),
    ((8, 3), (3, 2)),
    ((3, 2), (1, 3)),
    ((8, 0), (8, 3)),
    ((8, 3), (8, 1)),
]


@pytest.mark.parametrize("saved, restored", MATRIX)
def test_round_trip_reshards_across_stages_and_device_counts(tmp_path, saved, restored):
    opt = make_opt(*saved)
    state = train(opt, opt.init(awkward_params()), awkward_batches(2, batch_size=24))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state, extra={"position": 32})
    new_opt = make_opt(*restored)
    got = Checkpointer(tmp_path).restore(new_opt, awkward_params())
    assert (got.step, got.extra, got.skipped) == (2, {"position": 32}, ())
    assert int(got.state.step) == 2
    assert got.state.plan == new_opt.plan(awkward_params())  # the restoring layout
    want, have = opt.full_state(state), new_opt.full_state(got.state)
    assert_bitwise(have.params, want.params)
    assert_bitwise(have.opt_state, want.opt_state)
    # and the restored state trains on
    train(new_opt, got.state, awkward_batches(1, batch_size=24))


@pytest.mark.parametrize("direction", ["model_to_data", "data_to_model"])
def test_round_trip_with_and_without_a_model_axis(tmp_path, direction):
    model_mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    specs = {k: P() for k in awkward_params()} | {"emb": P("model")}  # (40, 13): model x data
    with_model = make_opt(mesh=model_mesh, param_specs=specs)
    plain = make_opt(8, 2)
    src, dst = (with_model, plain) if direction == "model_to_data" else (plain, with_model)
    state = train(src, src.init(awkward_params()), awkward_batches(2, batch_size=24))
    Checkpointer(tmp_path, async_save=False).save(2, state)
    got = Checkpointer(tmp_path).restore(dst, awkward_params()).state
    if dst is with_model:
        assert got.params["emb"].sharding.spec == P("model", "data")
    assert_bitwise(dst.full_state(got).params, src.full_state(state).params)
    assert_bitwise(dst.full_state(got).opt_state, src.full_state(state).opt_state)


def test_fp32_to_bf16_with_master_and_back(tmp_path):
    fp32 = make_opt(8, 3)
    state = train(fp32, fp32.init(awkward_params()), awkward_batches(2, batch_size=24))
    Checkpointer(tmp_path / "a", async_save=False).save(2, state)
    mixed = make_opt(4, 1, precision=BF16)
    got = Checkpointer(tmp_path / "a").restore(mixed, awkward_params()).state
    full = mixed.full_state(got)
    assert_bitwise(full.master, fp32.full_params(state))  # fp32 weights kept exactly
    assert_bitwise(full.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), full.master))
    got = train(mixed, got, awkward_batches(1, batch_size=24))
    Checkpointer(tmp_path / "b", async_save=False).save(3, got)
    back = Checkpointer(tmp_path / "b").restore(fp32, awkward_params()).state
    assert_bitwise(fp32.full_params(back), mixed.full_state(got).master)


@pytest.mark.parametrize("precision", [None, BF16])
def test_resume_equals_uninterrupted_bitwise(tmp_path, precision):
    batches = awkward_batches(4, batch_size=24)
    opt = make_opt(8, 3, precision=precision)
    straight = train(opt, opt.init(awkward_params()), batches)
    state = train(opt, opt.init(awkward_params()), batches[:2])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
    resumed = Checkpointer(tmp_path).restore(opt, awkward_params()).state
    resumed = train(opt, resumed, batches[2:])
    assert_bitwise(opt.full_state(resumed).params, opt.full_state(straight).params)
    assert_bitwise(opt.full_state(resumed).opt_state, opt.full_state(straight).opt_state)
    assert int(resumed.step) == 4


def test_resume_after_resharding_within_fp32_rounding(tmp_path):
    batches = awkward_batches(4, batch_size=24)
    opt = make_opt(8, 3)
    straight = train(opt, opt.init(awkward_params()), batches)
    Checkpointer(tmp_path, async_save=False).save(
        2, train(opt, opt.init(awkward_params()), batches[:2])
    )
    other = make_opt(4, 1)
    resumed = train(
        other, Checkpointer(tmp_path).restore(other, awkward_params()).state, batches[2:]
    )
    for g, w in zip(
        jax.tree.leaves(other.full_params(resumed)), jax.tree.leaves(opt.full_params(straight))
    ):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_async_save_then_donating_steps_stores_the_state_at_save_time(tmp_path):
    opt = make_opt(8, 3)
    state = train(opt, opt.init(awkward_params()), awkward_batches(2, batch_size=24))
    saved = jax.tree.map(np.asarray, opt.full_state(state).params)
    ckpt = Checkpointer(tmp_path)  # async
    ckpt.save(2, state)
    state = train(
        opt, state, awkward_batches(3, batch_size=24)
    )  # donates the saved state's buffers
    assert jax.tree.leaves(state.params)[0].is_deleted() is False
    ckpt.wait()
    got = Checkpointer(tmp_path).restore(opt, awkward_params()).state
    assert_bitwise(opt.full_state(got).params, saved)


def test_model_state_and_loss_scale_round_trip(tmp_path):
    fp16 = jzero.Precision(param_dtype=jnp.float16)
    opt = make_opt(8, 2, precision=fp16)
    stats = {"bn": {"mean": jnp.arange(5.0), "count": jnp.int32(7)}}
    state = opt.init(awkward_params(), model_state=stats)
    Checkpointer(tmp_path, async_save=False).save(0, state)
    got = Checkpointer(tmp_path).restore(opt, awkward_params()).state
    assert_bitwise(got.model_state, stats)
    assert float(got.loss_scale.scale) == fp16.initial_loss_scale
    assert got.model_state["bn"]["mean"].sharding.spec == P()


def test_max_to_keep_save_every_and_latest_step(tmp_path):
    opt = make_opt(8, 1)
    state = opt.init(awkward_params())
    ckpt = Checkpointer(tmp_path, max_to_keep=2, save_every=2)
    assert ckpt.latest_step() is None
    saved = [ckpt.save(step, state) for step in range(6)]
    ckpt.save(7, state, force=True)
    ckpt.wait()
    assert saved == [True, False, True, False, True, False]
    assert ckpt.all_steps() == [4, 7] and ckpt.latest_step() == 7


# ------------------------------------------------------------------------- integrity
def _saved_twice(tmp_path):
    """Checkpoints 1 and 2 of a model with random (incompressible) weights."""
    opt = make_opt(8, 3)
    params = {"w": jax.random.normal(jax.random.key(0), (512, 256)), "v": jnp.arange(1000.0)}
    state = opt.init(params)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    return opt, params


def _largest_data_file(tmp_path, step):
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(tmp_path / str(step) / "state")
        for f in names
        if os.sep + "d" + os.sep in os.path.join(root, f)
    ]
    return max(files, key=os.path.getsize)


def _flip(path):
    middle = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        data = f.read(8)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


CORRUPTIONS = {
    "flipped bytes": (_flip, r"leaf 'weights.w' fails its checksum"),
    "truncated file": (_truncate, r"reading the arrays failed.*leaf 'weights.w'"),
    "deleted file": (os.remove, r"reading the arrays failed.*leaf 'weights.w'"),
}


# When tensorstore fails on a corrupt file, Orbax abandons its other reads: their
# coroutines and callbacks die later with "Event loop is closed" (printed, harmless; jzero
# has already reported the failure). Collected here (gc) so they stay in this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_checkpoint_is_refused_and_the_previous_one_restored(tmp_path, kind, caplog):
    opt, params = _saved_twice(tmp_path)
    damage, message = CORRUPTIONS[kind]
    damage(_largest_data_file(tmp_path, 2))
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint step 2: " + message):
        ckpt.restore(opt, params, step=2)
    with caplog.at_level(logging.WARNING, logger="jzero"):
        got = ckpt.restore(opt, params)
    assert got.step == 1 and [s for s, _ in got.skipped] == [2]
    assert "skipping step 2" in caplog.text
    assert_bitwise(opt.full_params(got.state), params)
    gc.collect()


def test_changed_tree_shape_or_optimizer_is_refused(tmp_path):
    opt, params = _saved_twice(tmp_path)
    ckpt = Checkpointer(tmp_path)
    differs = r"checkpoint step 2 in .* does not match what it is restored into .*"
    with pytest.raises(CheckpointMismatchError, match=differs + r"not in the .*'weights.u'"):
        ckpt.restore(opt, {**params, "u": jnp.ones(3)}, step=2)
    with pytest.raises(CheckpointMismatchError, match=differs + r"only in the .*'weights.v'"):
        ckpt.restore(opt, {"w": params["w"]}, step=2)
    with pytest.raises(
        CheckpointMismatchError,
        match=differs + r"leaf 'weights.v' is float32\[1000\] in the checkpoint but "
        r"float32\[999\] in the restoring model",
    ):
        ckpt.restore(opt, {**params, "v": jnp.ones(999)}, step=2)
    sgd = jzero.ZeroOptimizer(optax.sgd(0.1), opt.mesh, stage=3)
    with pytest.raises(
        CheckpointMismatchError,
        match=differs + r"optimizer state only in the checkpoint: \['opt_state.0.count', "
        r".*Optax state is \(ScaleByAdamState, EmptyState\), the restoring optimizer's is "
        r"\(EmptyState, EmptyState\)",
    ):
        ckpt.restore(sgd, params, step=2)
    with pytest.raises(CheckpointError, match=r"no checkpoint step 5 .*steps: \[1, 2\]"):
        ckpt.restore(opt, params, step=5)
    # The newest checkpoint is intact but of another model: that is said, not skipped.
    with pytest.raises(CheckpointMismatchError, match=differs + r"'weights.x'"):
        ckpt.restore(opt, {"x": jnp.ones(3)})


def test_bad_save_input_writes_nothing(tmp_path):
    opt = make_opt(8, 1)
    state = opt.init(awkward_params())
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="JSON-serialisable.*tolist"):
        ckpt.save(0, state, extra={"a": np.ones(3)})
    with pytest.raises(TypeError, match="takes a jzero.ZeroState"):
        ckpt.save(0, state.params)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ckpt.save(-1, state)
    assert ckpt.all_steps() == [] and os.listdir(tmp_path) == []
    ckpt.save(3, state)
    ckpt.wait()
    with pytest.raises(ValueError, match="checkpoint step 3 already exists in .*overwrite=True"):
        ckpt.save(3, state)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Checkpointer(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(opt, awkward_params())


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, optax, jzero
    from jzero.checkpoint import Checkpointer
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)
    params = {{"w": jax.random.normal(jax.random.key(0), (2048, 2048))}}
    state = opt.init(params)
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, state)
    ckpt.wait()
    ckpt.save(2, state)  # returns once the arrays are off the devices; writing goes on
    # Orbax makes step 2's temporary directory in the background: kill once it exists
    # (on a loaded machine it can come after save() returns), while it is still written.
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        n.startswith("2") for n in os.listdir(sys.argv[1])
    ):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_save_killed_part_way_leaves_the_previous_step_restorable(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE.format())
    ckpt_dir = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, str(script), str(ckpt_dir)], capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    leftovers = [n for n in os.listdir(ckpt_dir) if n.startswith("2")]
    assert leftovers and all("tmp" in n for n in leftovers), os.listdir(ckpt_dir)
    ckpt = Checkpointer(ckpt_dir)
    assert ckpt.latest_step() == 1
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)
    params = {"w": jax.random.normal(jax.random.key(0), (2048, 2048))}
    got = ckpt.restore(opt, params)
    assert got.step == 1 and got.skipped == ()
    assert_bitwise(opt.full_params(got.state), params)


# ------------------------------------------------------------------------------- CLI
def _cli(*argv):
    out = subprocess.run(
        [sys.executable, "-m", "jzero", "checkpoint", *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return out.returncode, out.stdout, out.stderr


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_cli_inspect_verify_and_export(tmp_path):
    opt = make_opt(8, 3, precision=BF16)
    state = train(opt, opt.init(awkward_params()), awkward_batches(1, batch_size=24))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, extra={"position": 24})
    code, out, err = _cli("inspect", tmp_path / "ckpt", "--verify")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 'ckpt'}: steps [1]"
    assert lines[1].startswith(
        "step 1: stage 3 on 8 devices (mesh data=8), params bfloat16 with fp32 master weights, "
        "20 leaves, "
    )
    assert lines[2] == 'extra: {"position": 24}'
    assert lines[3].split() == ["leaf", "shape", "dtype", "bytes", "checksum", "status"]
    assert lines[7].split()[:4] == ["weights.emb", "[40,13]", "float32", "2,080"]
    assert lines[-1] == "verified 20 of 20 leaves"

    code, out, err = _cli("export", tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert code == 0, err
    from safetensors.numpy import load_file

    exported = load_file(tmp_path / "model.safetensors")
    master = opt.full_state(state).master
    assert sorted(exported) == sorted(master)
    for name, want in master.items():
        np.testing.assert_array_equal(exported[name], want)

    for root, _, names in os.walk(tmp_path / "ckpt" / "1" / "state"):
        if os.path.basename(root) == "d":  # data files (small arrays sit in the tree nodes)
            for name in names:
                _flip(os.path.join(root, name))
    code, out, _ = _cli("inspect", tmp_path / "ckpt", "--verify")
    assert code == 1 and out.splitlines()[-1].endswith(": CORRUPT")
    assert any("MISMATCH" in line or "UNREADABLE" in line for line in out.splitlines())


def test_cli_bad_input(tmp_path):
    code, _, err = _cli("inspect", tmp_path / "missing")
    assert code == 2 and err.strip() == (
        f"python -m jzero checkpoint: error: {tmp_path / 'missing'} is not a directory; pass a "
        "checkpoint directory."
    )
    code, _, err = _cli("inspect", tmp_path)
    assert code == 2 and "no finished checkpoint in" in err
