"""``jzero.gpu_mesh``'s errors, each naming the fix. None needs the CUDA plugin: the
installed versions and JAX's platforms are read through functions these tests replace."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

import jzero
from jzero.core.gpu_target import topology

INSTALLED = {
    "jaxlib": "0.12.0.1",
    "jax-cuda12-plugin": "0.12.0.1",
    "jax-cuda12-pjrt": "0.12.0.1",
    "nvidia-cuda-nvcc-cu12": "12.9.86",
}
PINS = "pip install 'jzero[gpu-compile]' 'jax-cuda12-plugin==0.12.0.1' 'jax-cuda12-pjrt==0.12.0.1'"


def test_an_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown GPU 'h800': jzero.gpu_mesh knows a100, b200"):
        jzero.gpu_mesh("h800")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"devices": 0}, "devices must be a positive int, got 0"),
        ({"devices": 12, "hosts": 8}, r"hosts must divide devices; e.g. devices=8"),
        ({"axis_names": ("a", "b", "data")}, r"needs shape=, one size per axis"),
        ({"axis_names": ("data", "model"), "shape": (4, 4)}, r"shape \(4, 4\) does not fit"),
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jzero.gpu_mesh("h100", **kwargs)


def test_a_missing_plugin_names_the_extra_and_the_pins(monkeypatch):
    monkeypatch.setattr(topology, "_versions", lambda: INSTALLED | {"jax-cuda12-plugin": None})
    with pytest.raises(ImportError, match=r"jax-cuda12-plugin is not installed") as e:
        jzero.gpu_mesh("h100")
    assert PINS in str(e.value)


def test_missing_ptxas_names_the_extra(monkeypatch):
    monkeypatch.setattr(topology, "_versions", lambda: INSTALLED | {"nvidia-cuda-nvcc-cu12": None})
    with pytest.raises(ImportError, match=r"nvidia-cuda-nvcc-cu12 is not installed") as e:
        jzero.gpu_mesh("h100")
    assert PINS in str(e.value)


def test_a_plugin_of_another_version_names_jaxlibs(monkeypatch):
    other = {"jax-cuda12-plugin": "0.11.2", "jax-cuda12-pjrt": "0.11.2"}
    monkeypatch.setattr(topology, "_versions", lambda: INSTALLED | other)
    with pytest.raises(ImportError, match=r"does not match jaxlib 0.12.0.1 \(jax-cuda12-plugin "):
        jzero.gpu_mesh("h100")
    with pytest.raises(ImportError, match=re.escape(PINS)):
        jzero.gpu_mesh("h100")


@pytest.mark.parametrize("platforms", [None, "", "cuda", "cpu,cuda", "gpu"])
def test_jax_that_would_start_the_cuda_plugin_is_refused(platforms):
    with pytest.raises(RuntimeError, match=r"set JAX_PLATFORMS=cpu in the environment, or call"):
        topology._check_platforms(platforms)


def test_jax_on_the_cpu_is_accepted():
    topology._check_platforms(jax.config.jax_platforms)  # conftest's "cpu"
    topology._check_platforms("cpu")


def test_without_jax_platforms_it_refuses_before_jax_starts():
    """In a fresh process: refused before JAX starts its backends, so the CUDA plugin never
    fails (no cuDNN error on stderr) and JAX still starts afterwards."""
    code = (
        "import jax, jzero\n"
        "try:\n    jzero.gpu_mesh('h200')\n"
        "except RuntimeError as e:\n    print(e)\n"
        "jax.config.update('jax_platforms', 'cpu')\n"
        "print(len(jzero.gpu_mesh('h200').devices.flat) if "
        "jzero.core.gpu_target.topology._versions()['jax-cuda12-plugin'] else 8)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "but jax_platforms is None" in out.stdout
    assert out.stdout.strip().endswith("\n8")
    assert "cuDNN" not in out.stderr
