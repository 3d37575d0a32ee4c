"""Consolidated safetensors export and import (jzero.checkpoint.export).

Every exported file is read back by the ``safetensors`` library alone, in a subprocess that
does not import jzero or jax, and compared bitwise with what jzero holds.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tracemalloc
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _models import awkward_batches, awkward_loss, awkward_params
from safetensors.numpy import save

import jzero
from jzero.checkpoint import export as export_module
from jzero.checkpoint.export import (
    _gather_program,
    export_safetensors,
    leaf_names,
    load_safetensors,
    tensor_names,
    write_safetensors,
)

FP32 = jzero.Precision()
MIXED = jzero.Precision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)

# Reads a safetensors file with the safetensors library and numpy only (and ml_dtypes for a
# bf16 file: safetensors' numpy reader fails with "data type 'bfloat16' not understood"
# unless it is imported), and compares every tensor's dtype, shape and bytes with the
# expectation written beside it.
_READER = """
import json, sys
import numpy as np
from safetensors import safe_open
path, expected_npz, expected_json, bf16 = sys.argv[1:5]
if bf16 == "1":
    import ml_dtypes  # registers numpy's bfloat16, which safetensors' numpy reader needs
want = json.load(open(expected_json))
data = np.load(expected_npz)
with safe_open(path, "numpy") as f:
    assert list(f.offset_keys()) == want["names"], (list(f.offset_keys()), want["names"])
    assert f.metadata() == want["metadata"], f.metadata()
    for name in want["names"]:
        t = f.get_tensor(name)
        dtype, shape = want["leaves"][name]
        assert (str(t.dtype), list(t.shape)) == (dtype, shape), (name, t.dtype, t.shape)
        assert t.tobytes() == data[name].tobytes(), name
assert "jzero" not in sys.modules and "jax" not in sys.modules
print("ok", len(want["names"]))
"""


def _read_alone(tmp_path, path, expected: dict[str, np.ndarray], metadata: dict) -> None:
    names = list(expected)
    np.savez(
        tmp_path / "want.npz",
        **{n: np.ascontiguousarray(a).view(np.uint8) for n, a in expected.items()},
    )
    spec = {n: (str(a.dtype), list(a.shape)) for n, a in expected.items()}
    with open(tmp_path / "want.json", "w") as f:
        json.dump({"names": names, "metadata": metadata, "leaves": spec}, f)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _READER,
            str(path),
            str(tmp_path / "want.npz"),
            str(tmp_path / "want.json"),
            str(int(any(a.dtype == ml_dtypes.bfloat16 for a in expected.values()))),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(len(names))]


def _check_layout(path, names: list[str], nbytes: list[int]) -> None:
    """The header is 8-byte aligned, the tensors lie back to back in ``names`` order, and
    the file is exactly header + data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert n % 8 == 0
    assert [k for k in header if k != "__metadata__"] == names
    offset = 0
    for name, size in zip(names, nbytes):
        assert header[name]["data_offsets"] == [offset, offset + size], name
        offset += size
    assert os.path.getsize(path) == 8 + n + offset


def _trained(stage: int, precision: jzero.Precision, devices=None):
    opt = jzero.ZeroOptimizer(
        optax.adam(1e-2),
        jzero.data_mesh(devices),
        stage=stage,
        min_shard_size=1,
        precision=precision,
    )
    state = opt.init(awkward_params())
    step = opt.train_step(awkward_loss)
    for batch in awkward_batches(2):
        state, _ = step(state, batch)
    return opt, state


def _exported(opt, state) -> dict[str, np.ndarray]:
    """What the export should hold: the fp32 master weights, else the parameters."""
    tree = opt.full_state(state).master if opt.precision.mixed else opt.full_params(state)
    return dict(zip(leaf_names(tree), (np.asarray(x) for x in jax.tree.leaves(tree))))


def _like(dtype=jnp.float32):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), awkward_params())


# --- names ---


class Pair(NamedTuple):
    a: int
    b: int


def test_leaf_names_from_key_paths():
    tree = {
        "params": {"layers": {"w": 0}},
        "blocks": [{"kernel": 0}, {"kernel": 0}],
        "pair": Pair(0, 0),
        "t": (0,),
    }
    want = ["blocks.0.kernel", "blocks.1.kernel", "pair.a", "pair.b", "params.layers.w", "t.0"]
    assert leaf_names(tree) == want
    assert leaf_names(jax.tree.structure(tree)) == want


def test_leaf_names_refuses_collisions_and_bare_leaves():
    with pytest.raises(ValueError, match=r"both get the name 'a\.b'"):
        leaf_names({"a.b": 0, "a": {"b": 0}})
    assert leaf_names(jnp.zeros(3)) == [""]
    with pytest.raises(ValueError, match="single leaf"):
        tensor_names(jnp.zeros(3))


# --- the writer ---


def test_writer_matches_reference_bytes(tmp_path):
    """In the reference's tensor order (by dtype, then name), our file is byte-identical to
    ``safetensors.numpy.save``'s, padding and metadata included."""
    tensors = {
        "c": np.arange(3.0),
        "b": np.ones((2, 3), np.float32),
        "h": np.arange(4).astype(ml_dtypes.bfloat16),
        "a": np.arange(3, dtype=np.int8),
        "s": np.array(True),
    }
    metadata = {"format": "jzero"}  # one key: the reference orders several by a HashMap
    path = tmp_path / "w.safetensors"
    leaves = [(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(path, leaves, metadata=metadata)
    assert path.read_bytes() == save(tensors, metadata=metadata)
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_writer_holds_one_leaf_at_a_time(tmp_path):
    """numpy's allocations are traced: 16 fetched leaves of 4 MiB peak at about one."""
    leaf = 1 << 20
    leaves = [
        (f"w{i:02d}", (leaf,), np.float32, lambda i=i: np.full(leaf, i, np.float32))
        for i in range(16)
    ]
    path = tmp_path / "big.safetensors"
    gc.collect()
    tracemalloc.start()
    try:
        write_safetensors(path, leaves)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"writer: peak traced {peak / 2**20:.2f} MiB, one leaf {4 * leaf / 2**20:.2f} MiB")
    assert 0.9 * 4 * leaf < peak < 2.5 * 4 * leaf
    _check_layout(path, [n for n, *_ in leaves], [4 * leaf] * 16)
    got = load_safetensors(path)
    assert list(got) == [n for n, *_ in leaves]
    assert all(np.all(got[f"w{i:02d}"] == i) for i in range(16))


# --- export ---


@pytest.mark.parametrize("precision", [FP32, MIXED], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_export_read_by_safetensors_alone(tmp_path, stage, precision):
    opt, state = _trained(stage, precision)
    want = _exported(opt, state)
    assert all(a.dtype == np.float32 for a in want.values())

    path = tmp_path / "model.safetensors"
    names = export_safetensors(opt, state, path)
    assert names == list(want) == leaf_names(awkward_params())
    meta = {"format": "jzero", "stage": str(stage), "devices": "8", "dtype": "float32"}
    meta["source"] = "master" if precision.mixed else "params"
    _check_layout(path, names, [a.nbytes for a in want.values()])
    _read_alone(tmp_path, path, want, meta)

    path16 = tmp_path / "model-bf16.safetensors"
    assert export_safetensors(opt, state, path16, dtype=jnp.bfloat16) == names
    want16 = {n: a.astype(ml_dtypes.bfloat16) for n, a in want.items()}
    _read_alone(tmp_path, path16, want16, {**meta, "dtype": "bfloat16"})
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["model.safetensors", "model-bf16.safetensors", "want.npz", "want.json"]
    )


@pytest.mark.parametrize(
    "stage, precision, new_stage, devices",
    [(3, FP32, 1, 3), (1, MIXED, 3, 4), (0, FP32, 2, 4)],
    ids=["s3-to-s1-3dev", "s1-to-s3-4dev-mixed", "s0-to-s2-4dev"],
)
def test_round_trip_into_another_run(tmp_path, stage, precision, new_stage, devices):
    opt, state = _trained(stage, precision)
    want = _exported(opt, state)
    path = tmp_path / "model.safetensors"
    export_safetensors(opt, state, path)

    flat = load_safetensors(path)
    assert list(flat) == list(want)
    assert all(np.array_equal(flat[n], want[n]) for n in want)

    loaded = load_safetensors(path, like=_like())
    assert jax.tree.structure(loaded) == jax.tree.structure(awkward_params())
    opt2 = jzero.ZeroOptimizer(
        optax.adam(1e-2),
        jzero.data_mesh(jax.devices()[:devices]),
        stage=new_stage,
        min_shard_size=1,
        precision=precision,
    )
    state2 = opt2.init(loaded)
    assert _exported(opt2, state2).keys() == want.keys()
    for name, got in _exported(opt2, state2).items():
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    if precision.mixed:
        params = opt2.full_params(state2)
        for name, got in zip(leaf_names(params), jax.tree.leaves(params)):
            assert np.asarray(got).dtype == ml_dtypes.bfloat16
            assert np.asarray(got).tobytes() == want[name].astype(ml_dtypes.bfloat16).tobytes()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_export_streams_leaf_by_leaf(tmp_path, monkeypatch):
    """16 leaves of 1M float32 (64 MiB) from stage 3 on 8 devices: Python-traced host memory
    peaks under 2.5 leaves, resident memory grows by far less than the gathered model, and
    one gather program serves all 16 same-layout leaves."""
    leaf, count = 1 << 20, 16
    opt = jzero.ZeroOptimizer(optax.adam(1e-2), jzero.data_mesh(), stage=3)

    def init_fn():
        base = jnp.arange(leaf, dtype=jnp.float32).reshape(1024, 1024)
        return {f"w{i:02d}": base + i for i in range(count)}

    state = opt.init(init_fn=init_fn)
    path = tmp_path / "big.safetensors"
    misses = _gather_program.cache_info().misses
    gc.collect()
    tracemalloc.start()
    try:
        names = export_safetensors(opt, state, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(
        f"export: peak traced {peak / 2**20:.2f} MiB, one leaf {4 * leaf / 2**20:.2f} MiB, "
        f"model {4 * leaf * count / 2**20:.0f} MiB"
    )
    assert peak < 2.5 * 4 * leaf
    assert _gather_program.cache_info().misses - misses <= 1

    # tracemalloc does not see XLA's buffers: on CPU the gathered leaf is a device buffer
    # that np.asarray views without a copy. The process's resident memory does: sampled
    # before each leaf's gather (and at the end), it stays far below the 512 MiB that
    # gathering the whole model replicated on 8 devices adds (4 MiB x 16 leaves x 8).
    samples = []
    real = export_module.write_safetensors

    def spy(path, leaves, **kwargs):
        wrap = lambda fetch: lambda: (samples.append(_rss()), fetch())[1]
        return real(path, [(n, s, d, wrap(f)) for n, s, d, f in leaves], **kwargs)

    monkeypatch.setattr(export_module, "write_safetensors", spy)
    before = _rss()
    export_safetensors(opt, state, path)  # a second export compiles nothing new
    growth = max(samples + [_rss()]) - before
    print(f"export: resident memory grew at most {growth / 2**20:.1f} MiB")
    assert len(samples) == count
    assert growth < 4 * 8 * 4 * leaf
    stored = state.plan.params[0]
    program = _gather_program(state.plan.mesh, stored, np.dtype(np.float32))
    assert program._cache_size() == 1
    assert _gather_program.cache_info().misses - misses <= 1

    _check_layout(path, names, [4 * leaf] * count)
    got = load_safetensors(path)
    base = np.arange(leaf, dtype=np.float32).reshape(1024, 1024)
    for i, name in enumerate(names):
        np.testing.assert_array_equal(got[name], base + i, err_msg=name)


# --- bad input ---


def test_bad_paths(tmp_path):
    opt, state = _trained(3, FP32)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        export_safetensors(opt, state, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_safetensors(opt, state, tmp_path / "nope" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no safetensors file"):
        load_safetensors(tmp_path / "model.safetensors")
    assert os.listdir(tmp_path) == []


def test_bad_names_and_dtypes(tmp_path):
    path = tmp_path / "x.safetensors"
    x = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="two tensors are named 'a'"):
        write_safetensors(path, [("a", (3,), x.dtype, lambda: x)] * 2)
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors(path, [("__metadata__", (3,), x.dtype, lambda: x)])
    with pytest.raises(ValueError, match="'c'.*complex128.*safetensors cannot hold"):
        write_safetensors(path, [("c", (3,), np.complex128, lambda: x)])
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        write_safetensors(path, [("a", (3,), x.dtype, lambda: x)], metadata={"stage": 3})
    opt, state = _trained(2, FP32)
    with pytest.raises(ValueError, match=r"dtype.*must be .*got .*int32"):
        export_safetensors(opt, state, path, dtype=jnp.int32)
    assert os.listdir(tmp_path) == []


def test_like_must_match(tmp_path):
    opt, state = _trained(1, FP32)
    path = tmp_path / "model.safetensors"
    export_safetensors(opt, state, path)
    fewer = {k: v for k, v in _like().items() if k != "b2"}
    with pytest.raises(ValueError, match=r"unexpected \['b2'\]"):
        load_safetensors(path, like=fewer)
    with pytest.raises(ValueError, match=r"missing \['zz'\]"):
        load_safetensors(path, like={**_like(), "zz": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(ValueError, match=r"leaf 'w1': the file holds float32\[13, 7\], `like` "):
        load_safetensors(path, like={**_like(), "w1": jax.ShapeDtypeStruct((7, 13), jnp.float32)})
    with pytest.raises(ValueError, match=r"leaf 'b1': .*float32\[7\].*expects bfloat16\[7\]"):
        load_safetensors(path, like={**_like(), "b1": jnp.zeros(7, jnp.bfloat16)})
    # like may hold arrays too
    got = load_safetensors(path, like=awkward_params())
    assert got["w1"].shape == (13, 7)


def test_interrupted_write_leaves_no_file(tmp_path):
    path = tmp_path / "x.safetensors"
    x = np.ones(1000, np.float32)

    def boom():
        raise RuntimeError("disk on fire")

    leaves = [("a", (1000,), x.dtype, lambda: x), ("b", (1000,), x.dtype, boom)]
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_safetensors(path, leaves)
    assert os.listdir(tmp_path) == []

    path.write_bytes(b"the previous export")  # an existing file survives a failed write
    wrong = [("a", (1000,), x.dtype, lambda: x), ("b", (1000,), x.dtype, lambda: x[:10])]
    with pytest.raises(ValueError, match=r"tensor 'b': fetch\(\) returned float32\[10\]"):
        write_safetensors(path, wrong)
    assert os.listdir(tmp_path) == ["x.safetensors"]
    assert path.read_bytes() == b"the previous export"
