"""``jzero.gpu_mesh``'s spelling of a cluster (shared with ``target=`` and ``--target``) and
its errors, each naming the fix. None needs the CUDA plugin: a spelling is read before the
plugin is, and the installed versions and JAX's platforms are read through functions these
tests replace."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

import jzero
from jzero.core.gpu_target import topology
from jzero.core.gpu_target.cluster import FORMS, Cluster, parse_cluster

INSTALLED = {
    "jaxlib": "0.12.0.1",
    "jax-cuda12-plugin": "0.12.0.1",
    "jax-cuda12-pjrt": "0.12.0.1",
    "nvidia-cuda-nvcc-cu12": "12.9.86",
}
PINS = "pip install 'jzero[gpu-compile]' 'jax-cuda12-plugin==0.12.0.1' 'jax-cuda12-pjrt==0.12.0.1'"


@pytest.mark.parametrize(
    "spelled, keywords, cluster",
    [("h100:8", {}, ("h100", 1, 8)), ("h100", {"devices": 8}, ("h100", 1, 8)),
     ("h100", {}, ("h100", 1, 8)), ("h200:8x8", {}, ("h200", 8, 64)),
     ("h200:64", {}, ("h200", 8, 64)), ("h200", {"devices": 64}, ("h200", 8, 64)),
     ("H200", {"devices": 64, "hosts": 8}, ("h200", 8, 64)), ("V100-32GB:4", {}, ("v100", 1, 4)),
     ("b200:2x4", {}, ("b200", 2, 8)), ("a100", {"devices": 16, "hosts": 1}, ("a100", 1, 16))],
)  # fmt: skip
def test_one_spelling_of_a_cluster(spelled, keywords, cluster):
    """ "h100:8" and "h200:8x8", or a name with devices= / hosts=: what gpu_mesh, target= and
    --target all read (hosts of 8 above 8 GPUs, unless hosts= says otherwise)."""
    assert parse_cluster(spelled, **keywords) == Cluster(*cluster)
    assert Cluster(*cluster).name == f"{cluster[0]}:{cluster[1]}x{cluster[2] // cluster[1]}"


@pytest.mark.parametrize(
    "spelled, keywords, message",
    [("h800", {}, r"unknown GPU 'h800': jzero.gpu_mesh knows a100, b200, h100, h200, v100"),
     ("x100:8", {}, r"unknown GPU 'x100' in 'x100:8': jzero.gpu_mesh knows a100"),
     ("h100 64", {}, r"GPUs 'h100 64' are not spelled as jzero knows: write 'h100:8'"),
     ("h100:12", {}, r"12 GPUs do not split into hosts of 8; say the hosts, e\.g\. 'h100:2x6'"),
     ("h100", {"devices": 12}, r"12 GPUs do not split into hosts of 8; say the hosts"),
     ("h100:8", {"devices": 16}, r"'h100:8' already says how many GPUs; give the count once"),
     ("h200:8x8", {"hosts": 8}, r"already says how many GPUs"),
     ("h100:0", {}, r"'h100:0' has no GPUs; write 'h100:8'")],
)  # fmt: skip
def test_a_misspelled_cluster_lists_the_forms(spelled, keywords, message):
    """Refused before the plugin is read, by gpu_mesh as by the parser, with the forms."""
    with pytest.raises(ValueError, match=message) as e:
        jzero.gpu_mesh(spelled, **keywords)
    if "not spelled" in message or "unknown" in message or "no GPUs" in message:
        assert FORMS in str(e.value)
    with pytest.raises(ValueError, match=message):
        parse_cluster(spelled, **keywords)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"devices": 0}, "devices must be a positive int, got 0"),
        ({"devices": 12, "hosts": 8}, r"hosts must divide devices; e.g. devices=8"),
        ({"hosts": 0}, "hosts must be a positive int, got 0"),
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
