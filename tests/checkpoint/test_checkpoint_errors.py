"""Checkpoints never lose or misreport data: donated states, shared directories, extra that
would not come back as given, failed saves, and mistakes that must get a clear error.

Cases that used to crash (segfault) or hang the process run in tests/workers/checkpoint_worker.py,
in a subprocess with a hard timeout."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_params
from _paths import WORKERS
from safetensors.numpy import save_file

import jzero
from jzero.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    export_safetensors,
    load_safetensors,
)

WORKER = WORKERS / "checkpoint_worker.py"
# The failures fixed here held the process for ~300 s (Orbax's barrier timeout) or killed
# it; a normal run of a worker takes well under a minute even on a loaded 2-core machine.
WORKER_TIMEOUT = 200


def make_opt(tx=None, stage=3):
    tx = optax.adam(1e-2) if tx is None else tx
    return jzero.ZeroOptimizer(tx, jzero.data_mesh(), stage=stage, min_shard_size=1)


def run_worker(mode, directory):
    out = subprocess.run(
        [sys.executable, str(WORKER), mode, str(directory)],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,  # TimeoutExpired fails the test: the process did not exit
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "exiting", out.stdout  # the worker ran to its end
    return dict(line.split(" => ", 1) for line in lines[:-1])


def assert_params(opt, state, want):
    got = opt.full_params(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------- donated states
DONATED = (
    "ValueError: state leaf .step was deleted: this state was donated to (consumed by) an "
    "earlier train_step"
)


def test_save_and_export_of_a_donated_state_are_refused_without_a_crash(tmp_path):
    said = run_worker("donated", tmp_path)  # a segfault would be a negative return code
    assert said["save"].startswith(DONATED), said
    assert said["export"].startswith(DONATED), said
    assert said["save of the new state"] == "returned True"
    assert Checkpointer(tmp_path / "ckpt").all_steps() == [2]  # nothing of the donated one
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------------ failed saves
def test_a_failed_save_is_reported_at_the_next_call_and_the_process_exits(tmp_path):
    said = run_worker("failing", tmp_path)  # exits long before WORKER_TIMEOUT
    assert said["gone: save 1"].startswith(
        f"CheckpointSaveError: checkpoint step 1 was not saved to {tmp_path / 'gone'}: "
        "NotADirectoryError: [Errno 20] Not a directory"
    ), said
    assert said["gone: save 2"] == "returned True"  # usable again once the cause is gone
    not_saved = "CheckpointSaveError: checkpoint step {} was not saved to {}: ValueError: "
    too_large = "File too large [os_error_code='27']. The checkpoints finished before it are intact"
    # (which write fails first, and so the rest of the OS error's line, varies with timing)
    for call, step in (("save 2", 1), ("wait", 2), ("close", 3)):  # the next call reports it
        message = said[f"full: {call}"]
        assert message.startswith(not_saved.format(step, tmp_path / "full")), said
        assert too_large in message, message
    assert said["full: save 2 again"] == "returned True"
    # save_every=10: a save that is not due reports the failure as soon as it is known
    message = said["every10: save 11 (not due)"]
    assert message.startswith(not_saved.format(10, tmp_path / "every10")), message
    assert too_large in message, message
    assert said["every10: close"] == "returned None"  # reported once
    # what was saved before the failures is intact and restores
    for name in ("full", "every10"):
        ckpt = Checkpointer(tmp_path / name)
        assert ckpt.all_steps() == [0]
        params = {"w": jax.random.normal(jax.random.key(0), (512, 512))}
        restored = ckpt.restore(make_opt(), params)
        assert restored.step == 0 and restored.skipped == ()
        assert_params(make_opt(), restored.state, params)


def test_the_os_error_is_kept_whichever_line_of_the_storage_error_names_it():
    from jzero.checkpoint.errors import storage_error_line as _first_line

    tail = "File too large [os_error_code='27']"
    spec = " [source locations='tensorstore/kvstore/file/file_key_value_store.cc:123']"
    long = "x" * 500
    two_lines = ValueError(f"OUT_OF_RANGE: Error writing\nError writing {long}: {tail}{spec}")
    assert _first_line(two_lines).endswith(tail)
    assert _first_line(ValueError(f"Error writing: {tail}. See full TensorStore details: x")) == (
        f"Error writing: {tail}"
    )
    assert _first_line(ValueError("first line.\nsecond line")) == "first line"
    # a failed metadata write: tensorstore puts its spec (JSON, "[]" inside) before the code
    path = "/tmp/pytest-of-root/pytest-99/popen-gw0/test_a_failed_save_is_reported0/full"
    json = '{"driver":"zarr","metadata":{"shape":[],"compressor":{"id":"zstd"}},' * 8 + "}"
    spec = f"[tensorstore_spec='{json}']"
    metadata = ValueError(
        f'OUT_OF_RANGE: Error opening "zarr" driver: Error writing "step/.zarray" in OCDBT '
        f'database at local file "{path}/1.orbax-checkpoint-tmp/": Failed writing: "{path}/d/0f": '
        f"Failed to write 9 bytes to file 4: File too large {spec} [os_error_code='27']"
    )
    line = _first_line(metadata)
    assert line.startswith('OUT_OF_RANGE: Error opening "zarr" driver') and line.endswith(
        "File too large [os_error_code='27']"
    ), line
    assert "zstd" not in line and len(line) <= 405, line
    # the order tensorstore gave here (a metadata write beside a large one): the code first
    after = ValueError(
        str(metadata).replace(f"{spec} [os_error_code='27']", f"[os_error_code='27'] {spec}")
    )
    assert _first_line(after) == line


# ------------------------------------------------------------- two writers, one directory
def test_a_step_on_disk_is_never_overwritten_whoever_wrote_it(tmp_path):
    opt = make_opt()
    mine, theirs = awkward_params(seed=0), awkward_params(seed=1)
    first, second = Checkpointer(tmp_path), Checkpointer(tmp_path)
    first.save(1, opt.init(mine))
    first.wait()  # first now knows step 1 only
    second.save(2, opt.init(theirs))
    second.wait()
    with pytest.raises(ValueError, match=r"checkpoint step 2 already exists .*overwrite=True"):
        first.save(2, opt.init(mine))
    with pytest.raises(ValueError, match=r"step 1 already exists"):
        first.save(1, opt.init(mine))
    assert_params(opt, first.restore(opt, mine, step=2).state, theirs)  # second's, intact
    first.save(3, opt.init(mine))  # a newer step is fine, and the other writer sees it
    first.wait()
    assert second.all_steps() == [1, 2, 3] and second.latest_step() == 3
    with pytest.raises(ValueError, match=r"step 2 already exists .*the newest is 3"):
        second.save(2, opt.init(theirs))
    first.save(2, opt.init(mine), overwrite=True)  # asked for: replaces that one step
    first.close()
    assert_params(opt, second.restore(opt, mine, step=2).state, mine)
    second.close()
    assert Checkpointer(tmp_path).all_steps() == [1, 2, 3]


def test_a_step_older_than_the_newest_on_disk_is_refused(tmp_path):
    opt = make_opt()
    state = opt.init(awkward_params())
    other = Checkpointer(tmp_path, async_save=False)
    ckpt = Checkpointer(tmp_path, async_save=False)
    assert ckpt.all_steps() == []
    other.save(5, state)
    with pytest.raises(ValueError, match=r"step 4 is older than the newest .*\(the newest is 5"):
        ckpt.save(4, state)
    with pytest.raises(ValueError, match=r"step 4 is older"):
        ckpt.save(4, state, overwrite=True)  # overwrite replaces a step; it adds no old one
    assert ckpt.save(6, state) and ckpt.all_steps() == [5, 6]


# -------------------------------------------------------------------------------- extra
def test_extra_comes_back_exactly_or_is_refused(tmp_path):
    opt = make_opt(stage=1)
    state = opt.init(awkward_params())
    ckpt = Checkpointer(tmp_path)
    refused = [
        ({0: "a"}, r"extra has the key 0 \(int\); .* come back as '0'\. Use str keys"),
        ({"a": {1.5: 2}}, r"extra\['a'\] has the key 1\.5 \(float\)"),
        ({"a": [{None: 1}]}, r"extra\['a'\]\[0\] has the key None"),
        ({"pos": (1, 2)}, r"extra\['pos'\] is a tuple, which JSON stores as a list.*pass a list"),
    ]
    for extra, message in refused:
        with pytest.raises(TypeError, match=message):
            ckpt.save(0, state, extra=extra)
    assert ckpt.all_steps() == [] and not os.path.exists(tmp_path / "0")
    extra = {"step": 3, "lr": 0.5, "seen": [1, 2.0, "x", None, True], "nested": {"k": {}}}
    ckpt.save(0, state, extra=extra)
    ckpt.close()
    got = Checkpointer(tmp_path).restore(opt, awkward_params()).extra
    assert got == extra
    assert [type(x) for x in got["seen"]] == [int, float, str, type(None), bool]


# ------------------------------------------------------------------------ clear errors
def test_a_closed_checkpointer_says_so(tmp_path):
    opt = make_opt(stage=1)
    state = opt.init(awkward_params())
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    ckpt.close()  # twice is fine
    closed = r"this Checkpointer of .* was closed .*create a new jzero.Checkpointer\(directory\)"
    with pytest.raises(RuntimeError, match=closed):
        ckpt.save(2, state)
    with pytest.raises(RuntimeError, match=closed):
        ckpt.wait()
    with pytest.raises(RuntimeError, match=closed):
        ckpt.restore(opt, awkward_params())
    assert Checkpointer(tmp_path).all_steps() == [1]
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1  # listing needs no manager
    missing = Checkpointer(tmp_path / "none")
    missing.close()
    assert missing.all_steps() == []


def test_an_optax_transformation_or_a_state_in_the_wrong_place_is_refused(tmp_path):
    opt = make_opt()
    state = opt.init(awkward_params())
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    takes = r"takes the jzero.ZeroOptimizer, got an Optax transformation .*jzero.ZeroOptimizer\(tx"
    with pytest.raises(TypeError, match="restore\\(\\) " + takes):
        Checkpointer(tmp_path).restore(optax.adam(1e-2), awkward_params())
    with pytest.raises(TypeError, match="export_safetensors\\(\\) " + takes):
        export_safetensors(optax.adam(1e-2), state, tmp_path / "model.safetensors")
    with pytest.raises(TypeError, match=r"takes the parameters .*not a jzero.ZeroState"):
        Checkpointer(tmp_path).restore(opt, state)
    with pytest.raises(TypeError, match=r"step must be an int or None .*got '1'"):
        Checkpointer(tmp_path).restore(opt, awkward_params(), step="1")
    assert not (tmp_path / "model.safetensors").exists()


def test_load_safetensors_of_something_else_says_what_it_is(tmp_path):
    (tmp_path / "notes.txt").write_text("not a tensor file\n" * 10)
    save_file({"w": np.ones((64, 64), np.float32)}, tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    for name in ("notes.txt", "cut.safetensors"):
        with pytest.raises(ValueError, match=rf"'.*{name}' is not a safetensors file, or is "):
            load_safetensors(tmp_path / name)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, make_opt(stage=1).init(awkward_params()))
    with pytest.raises(IsADirectoryError, match=r"is a directory.*Checkpointer\(path\).restore"):
        load_safetensors(tmp_path / "ckpt")
    assert load_safetensors(tmp_path / "good.safetensors")["w"].shape == (64, 64)


def test_a_checkpoint_of_another_model_is_a_mismatch_not_corruption(tmp_path, caplog):
    opt = make_opt()
    params = awkward_params()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, opt.init(params))
        ckpt.save(2, opt.init(params))
    ckpt = Checkpointer(tmp_path)
    momentum = make_opt(optax.sgd(0.1, momentum=0.9))
    intact = r"checkpoint step 2 in .* does not match what it is restored into \(it is intact, not"
    with caplog.at_level(logging.WARNING, logger="jzero"):
        with pytest.raises(CheckpointMismatchError, match=intact) as e:
            ckpt.restore(momentum, params)
        assert "Optax state is (ScaleByAdamState, EmptyState), the restoring optimizer's is " in (
            str(e.value)
        )
        assert "(TraceState, EmptyState)" in str(e.value)
        bigger = {**params, "emb": jnp.ones((41, 13))}
        with pytest.raises(
            CheckpointMismatchError,
            match=intact + r".*'weights.emb' is float32\[40, 13\] in the checkpoint but "
            r"float32\[41, 13\] in the restoring model",
        ):
            ckpt.restore(opt, bigger)
    assert "skipping" not in caplog.text  # no checkpoint was called invalid
    # A corrupt newer checkpoint is skipped as before, and said beside the mismatch.
    (tmp_path / "2" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"checkpoint step 1 .* does not match.*\(skipped before it: step 2: checkpoint "
        r"step 2: metadata unreadable",
    ):
        ckpt.restore(momentum, params)
    got = ckpt.restore(opt, params)  # and the matching model restores step 1
    assert got.step == 1 and [s for s, _ in got.skipped] == [2]


def test_reading_a_missing_directory_creates_nothing(tmp_path):
    missing = tmp_path / "no" / "such"
    ckpt = Checkpointer(missing)
    assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    opt = make_opt(stage=1)
    with pytest.raises(CheckpointNotFoundError, match=r"directory .*no/such does not exist"):
        ckpt.restore(opt, awkward_params())
    with pytest.raises(FileNotFoundError, match="does not exist"):  # also a FileNotFoundError
        ckpt.metadata(1)
    with pytest.raises(CheckpointError, match="does not exist"):  # and a CheckpointError
        Checkpointer(missing).restore(opt, awkward_params(), step=1)
    assert not (tmp_path / "no").exists()
    ckpt.save(1, opt.init(awkward_params()))  # the first save creates it
    ckpt.close()
    assert Checkpointer(missing).all_steps() == [1]


def _edit_meta(directory, step, edit) -> None:
    """Rewrites checkpoint ``step``'s metadata JSON through ``edit(meta)``, arrays untouched."""
    path = directory / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _two_steps(directory):
    opt, params = make_opt(), awkward_params()
    state = opt.init(params)
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state)
        state, _ = opt.train_step(_models.awkward_loss)(state, _models.awkward_batches(1)[0])
        ckpt.save(2, state)
    return opt, params


def _shape_edited(meta):
    meta["leaves"]["weights.emb"]["shape"] = [41, 13]  # every array and checksum as saved


def test_damaged_metadata_is_a_corrupt_step_the_previous_one_restored(tmp_path, caplog):
    opt, params = _two_steps(tmp_path)
    _edit_meta(tmp_path, 2, _shape_edited)
    ckpt = Checkpointer(tmp_path)
    damaged = r"checkpoint step 2 in .*: its metadata fails its checksum \(stored "
    with caplog.at_level(logging.WARNING, logger="jzero"):
        got = ckpt.restore(opt, params)  # step=None: the newest intact step
    assert got.step == 1 and [s for s, _ in got.skipped] == [2]
    assert re.search(damaged, got.skipped[0][1])
    assert re.search(r"skipping step 2: " + damaged, caplog.text)
    with pytest.raises(CheckpointError, match=damaged) as e:
        ckpt.restore(opt, params, step=2)  # named: the corrupt-step error
    assert not isinstance(e.value, CheckpointMismatchError)
    assert "intact" not in str(e.value)


def test_a_real_mismatch_beside_protected_metadata_is_still_a_mismatch(tmp_path):
    _, params = _two_steps(tmp_path)
    momentum = make_opt(optax.sgd(0.1, momentum=0.9))
    with pytest.raises(CheckpointMismatchError, match=r"it is intact, not corrupt"):
        Checkpointer(tmp_path).restore(momentum, params)


def test_metadata_of_older_jzero_without_its_checksum_still_restores(tmp_path):
    opt, params = _two_steps(tmp_path)
    _edit_meta(tmp_path, 2, lambda meta: meta.pop("meta_checksum"))  # as older jzero wrote
    got = Checkpointer(tmp_path).restore(opt, params)
    assert got.step == 2 and got.skipped == ()
    _edit_meta(tmp_path, 2, _shape_edited)  # unprotected: told from the arrays, as before
    with pytest.raises(CheckpointMismatchError, match=r"'weights.emb' is float32\[41, 13\]"):
        Checkpointer(tmp_path).restore(opt, params, step=2)
