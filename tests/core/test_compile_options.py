"""The XLA options jzero's step is compiled with (``jzero.core.compile_options``): XLA:GPU's
reduce-scatter pipeliner off on GPU meshes, nothing elsewhere. What the option does to the
compiled GPU program is read in ``gpu_target/test_compiled_for_gpus.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import jzero
from jzero.core import compile_options
from jzero.core.compile_options import PIPELINE_OFF, PIPELINE_SCATTER, step_compiler_options
from jzero.internal.moved import InternalMovedWarning


def _mesh_of(platform: str) -> SimpleNamespace:
    """What the options read of a mesh: its devices' platform."""
    return SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)] * 2))


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_a_gpu_step_is_compiled_without_the_reduce_scatter_pipeliner(platform):
    config = jzero.ZeroConfig(stage=3)
    assert step_compiler_options(config, _mesh_of(platform)) == {PIPELINE_SCATTER: PIPELINE_OFF}


def test_other_platforms_and_pipeline_scatter_keep_xlas_defaults():
    pipelined = jzero.ZeroConfig(stage=2, comm=jzero.Communication(pipeline_scatter=True))
    assert step_compiler_options(pipelined, _mesh_of("gpu")) is None
    assert step_compiler_options(jzero.ZeroConfig(stage=3), jzero.data_mesh()) is None  # CPU
    assert step_compiler_options(jzero.ZeroConfig(stage=3), _mesh_of("tpu")) is None


def test_the_installed_jaxlib_knows_the_option():
    """XLA renamed it once (``xla_gpu_enable_pipelined_reduce_scatter``, a boolean, is
    refused as a compile option): the name and value jzero passes must still compile."""
    compile_options._accepted.cache_clear()
    assert compile_options._accepted(PIPELINE_SCATTER, PIPELINE_OFF)


def test_a_refused_option_falls_back_to_xlas_default_with_a_warning(monkeypatch):
    compile_options._accepted.cache_clear()
    old_name = "xla_gpu_enable_pipelined_reduce_scatter"
    monkeypatch.setattr(compile_options, "PIPELINE_SCATTER", old_name)
    with pytest.warns(InternalMovedWarning, match=rf"{old_name}=\S+ \(refused: .*No such"):
        assert step_compiler_options(jzero.ZeroConfig(stage=3), _mesh_of("gpu")) is None
    compile_options._accepted.cache_clear()
