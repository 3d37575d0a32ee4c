"""Dtypes as users write them: ``Precision`` and ``export_safetensors(dtype=)`` read a dtype,
its name, or DeepSpeed's short names ``'bf16'`` / ``'fp16'`` / ``'fp32'`` (through
``jzero.core.dtypes``), and refuse anything else echoing the value exactly as it was given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import awkward_params

import jzero
from jzero.checkpoint import export_safetensors, load_safetensors

ALIASES = [("bf16", jnp.bfloat16), ("fp16", jnp.float16), ("fp32", jnp.float32)]


@pytest.mark.parametrize("name, dtype", ALIASES + [("BF16", jnp.bfloat16)])
def test_precision_takes_deepspeed_short_names(name, dtype):
    precision = jzero.Precision(param_dtype=name)
    assert precision == jzero.Precision(param_dtype=dtype)
    assert precision.param_dtype == np.dtype(dtype) and precision.reduce_dtype == np.dtype(dtype)
    assert jzero.Precision(param_dtype="bf16", reduce_dtype=name).reduce_dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    "value, shown",
    [
        ("bf8", r"'bf8'"),
        ("float", r"'float' \(NumPy reads it as float64\)"),
        (None, r"None"),
        (jnp.int8, r"<class 'jax.numpy.int8'>"),
        (np.dtype("complex64"), r"dtype\('complex64'\)"),
    ],
)
def test_precision_echoes_the_value_given(value, shown):
    fields = ("param_dtype",) if value is None else ("param_dtype", "reduce_dtype")
    for field in fields:  # reduce_dtype=None means param_dtype's
        message = rf"Precision.{field} must be float32, bfloat16 or float16, got {shown}; "
        message += rf"e.g. Precision\({field}=jnp.bfloat16\) \(a dtype, its name, or one of "
        message += r"the short names 'bf16', 'fp16', 'fp32'\)\."
        with pytest.raises(ValueError, match=message):
            jzero.Precision(**{field: value})


@pytest.fixture(scope="module")
def trained():
    opt = jzero.ZeroOptimizer(optax.sgd(0.1), jzero.data_mesh(), stage=3)
    return opt, opt.init(awkward_params())


@pytest.mark.parametrize("name, dtype", ALIASES)
def test_export_takes_deepspeed_short_names(trained, tmp_path, name, dtype):
    opt, state = trained
    path = tmp_path / "model.safetensors"
    export_safetensors(opt, state, path, dtype=name)
    loaded = load_safetensors(path)
    want = jax.tree.map(lambda x: np.asarray(x).astype(dtype), awkward_params())
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "value, shown", [("bf8", r"'bf8'"), (jnp.int8, r"<class 'jax.numpy.int8'>")]
)
def test_export_echoes_the_value_given(trained, tmp_path, value, shown):
    opt, state = trained
    floats = "float8_e5m2, float8_e4m3fn, float16, bfloat16, float32 or float64"
    message = rf"export_safetensors\(dtype=...\) must be {floats}, got {shown}; e.g. "
    message += r"dtype=jnp.bfloat16, or None to keep the source's dtype \(float32\)"
    with pytest.raises(ValueError, match=message):
        export_safetensors(opt, state, tmp_path / "model.safetensors", dtype=value)
    assert not (tmp_path / "model.safetensors").exists()  # refused before writing
