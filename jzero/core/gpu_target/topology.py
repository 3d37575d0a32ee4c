"""Meshes of GPUs that are not here: XLA's GPU compiler, run on a machine without them.

With JAX's CUDA plugin installed (the ``gpu-compile`` extra) and JAX running on the CPU,
``jax.experimental.topologies`` describes a CUDA cluster from a GPU's
``GpuTargetConfigProto`` (``specs/*.txtpb``: XLA's published specs, trimmed to the fields
jaxlib parses). Its devices are compile-only (:mod:`.compile_only`): ``jax.jit`` programs
over them lower and compile through the real XLA:GPU pipeline (SPMD partitioning,
collective combiners, the latency-hiding scheduler, buffer assignment), and
``memory_analysis()`` gives what each GPU would hold. Nothing runs on them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import logging
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from .cluster import SPECS, parse_cluster

logger = logging.getLogger("jzero")

CUDA = {  # CUDA major -> JAX's CUDA plugin distributions, and ptxas' distribution
    "12": (("jax-cuda12-plugin", "jax-cuda12-pjrt"), "nvidia-cuda-nvcc-cu12"),
    "13": (("jax-cuda13-plugin", "jax-cuda13-pjrt"), "nvidia-cuda-nvcc"),
}
"""JAX's CUDA plugins: CUDA 12's, which the gpu-compile extra installs, or CUDA 13's
(the only one jax 0.12.1 ships; compiling for compile-only GPUs with it was checked by
hand on jax 0.12.1). Either at jaxlib's exact version."""


def gpu_mesh(
    gpu: str,
    *,
    devices: int | None = None,
    hosts: int | None = None,
    axis_names: Sequence[str] = ("data",),
    shape: Sequence[int] | None = None,
) -> Mesh:
    """A mesh of compile-only GPUs (``"h100:8"``, ``"h200:8x8"``: hosts of 8), for
    compiling here what a GPU cluster would run.

    Programs over it lower and compile through XLA's GPU compiler for that GPU
    (``jax.jit(f).trace(*shapes).lower().compile()``), without the GPUs: read the
    compiled program's ``memory_analysis()``, ``as_text()`` or :func:`jzero.report`.
    Nothing can run on it: placing arrays, ``ZeroOptimizer.init`` and a train step's call
    are refused, and so is offload (XLA drops memory kinds on these devices).

    It needs the ``gpu-compile`` extra at jaxlib's exact version (``pip install
    'jzero[gpu-compile]' 'jax-cuda12-plugin==V' 'jax-cuda12-pjrt==V'``, V =
    ``jaxlib.__version__``) and JAX on the CPU: ``JAX_PLATFORMS=cpu``, or
    ``jax.config.update("jax_platforms", "cpu")`` before JAX touches a device. The CPU
    devices stay usable beside it.

    Args:
        gpu: the GPUs, spelled as ``target=`` and ``--target`` spell them: ``"h100:8"``
            (8 H100s on one host), ``"h100:64"`` (64 in hosts of 8), ``"h200:8x8"``
            (HOSTSxGPUS: 8 hosts of 8); or a GPU's name alone, with ``devices=`` and
            ``hosts=``. The names, case-insensitive: ``"h100"`` (SXM, 80 GB), ``"h200"``,
            ``"a100"`` (SXM, 80 GB), ``"b200"``, ``"v100"`` (SXM2, 32 GB), ``"v100-16gb"``;
            or an alias, ``"h100-sxm"``, ``"a100-80gb"``, ``"v100-32gb"``
            (:func:`jzero.core.gpu_target.gpu_names`). The specs are XLA's
            (``jzero/core/gpu_target/specs/``).
        devices: the number of GPUs in all, when ``gpu`` is a name alone (default 8).
        hosts: the number of hosts (nodes) they are spread over, ``devices // hosts``
            each; it must divide ``devices``. Default: one host up to 8 GPUs, hosts of 8
            above, as ``"h100:64"``. Devices are listed host by host.
        axis_names: the mesh's axis names; ``("data",)`` for jzero's default mesh.
        shape: the mesh's shape, one size per axis name, multiplying to ``devices``.
            Default: ``(devices,)`` for one axis; for two, ``(hosts, devices // hosts)``,
            so that ``axis_names=("replica", "data")`` shards within each host and
            replicates across hosts (hybrid sharding, as :func:`jzero.hybrid_mesh`).

    Examples:
        >>> mesh = jzero.gpu_mesh("h100:8x8")  # or ("h100:64"), ("h100", devices=64, hosts=8)
        >>> mesh.devices.size, mesh.devices.flat[0].device_kind
        (64, 'NVIDIA H100 80GB HBM3')
        >>> x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32,
        ...                          sharding=NamedSharding(mesh, P("data")))
        >>> compiled = jax.jit(lambda x: x @ x.T).trace(x).lower().compile()
        >>> compiled.memory_analysis().output_size_in_bytes  # one row block per GPU
        1048576
    """
    cluster = parse_cluster(gpu, devices=devices, hosts=hosts)
    devices, hosts = cluster.devices, cluster.hosts
    shape = _mesh_shape(devices, hosts, tuple(axis_names), shape)
    _check_plugin(_versions())
    _check_platforms(jax.config.jax_platforms)
    grid = np.array(_topology_devices(cluster.gpu, devices, hosts), dtype=object).reshape(shape)
    mesh = Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))
    logger.info(
        "jzero.gpu_mesh: %s over %d compile-only %s GPU(s) on %d host(s)",
        dict(mesh.shape),
        devices,
        grid.flat[0].device_kind,
        hosts,
    )
    return mesh


def device_memory_size(gpu: str) -> int:
    """The bytes of memory one ``gpu`` (a name of :data:`.cluster.SPECS`) has: its spec's
    ``device_memory_size``."""
    name = parse_cluster(gpu).gpu
    spec = importlib.resources.files(__package__).joinpath("specs", SPECS[name]).read_text()
    return int(re.search(r"device_memory_size:\s*(\d+)", spec).group(1))


def _mesh_shape(
    devices: int, hosts: int, axis_names: tuple[str, ...], shape: Sequence[int] | None
) -> tuple[int, ...]:
    if shape is None and len(axis_names) == 1:
        return (devices,)
    if shape is None and len(axis_names) == 2:
        return (hosts, devices // hosts)
    if shape is None:
        raise ValueError(
            f"gpu_mesh: axis_names {axis_names} needs shape=, one size per axis "
            f"multiplying to devices={devices}."
        )
    shape = tuple(shape)
    if len(shape) != len(axis_names) or math.prod(shape) != devices:
        raise ValueError(
            f"gpu_mesh: shape {shape} does not fit axis_names {axis_names} over "
            f"{devices} devices; give one size per axis name, multiplying to {devices}."
        )
    return shape


@functools.cache  # one topology per cluster: meshes over it share devices (and jit caches)
def _topology_devices(name: str, devices: int, hosts: int) -> tuple[jax.Device, ...]:
    spec = importlib.resources.files(__package__).joinpath("specs", SPECS[name]).read_text()
    try:
        topology = topologies.get_topology_desc(
            name, "cuda", target_config=spec, topology=f"1x{hosts}x{devices // hosts}"
        )
    except Exception as e:  # NotImplementedError when the plugin did not start
        raise RuntimeError(
            f"JAX could not describe a CUDA topology for {name!r} ({type(e).__name__}: {e}). "
            f"{_PLATFORMS_FIX} If JAX already started in this process, restart it."
        ) from e
    return tuple(topology.devices)


def _versions() -> dict[str, str | None]:
    """The installed versions of jaxlib, the CUDA plugins and ptxas' distributions (None:
    not installed)."""
    out = {}
    for dist in ("jaxlib", *(d for plugin, ptxas in CUDA.values() for d in (*plugin, ptxas))):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _cuda(versions: dict[str, str | None]) -> tuple[tuple[str, str], str]:
    """The CUDA plugin (and ptxas) in use: the one installed (CUDA 12's if both are);
    CUDA 12's where none is (what the gpu-compile extra installs)."""
    installed = [c for c, (plugin, _) in CUDA.items() if versions.get(plugin[0])]
    return CUDA[installed[0] if installed else "12"]


def cuda_plugin() -> str:
    """JAX's CUDA plugin compiles go through, with its version (for a run's record), e.g.
    ``"jax-cuda12-plugin 0.12.0.1"``; ``"none"`` where none is installed."""
    versions = _versions()
    plugin = _cuda(versions)[0][0]
    return f"{plugin} {versions[plugin]}" if versions.get(plugin) else "none"


def _install_hint(jaxlib: str) -> str:
    return (
        f"pip install 'jzero[gpu-compile]' 'jax-cuda12-plugin=={jaxlib}' "
        f"'jax-cuda12-pjrt=={jaxlib}'"
    )


def _check_plugin(versions: dict[str, str | None]) -> None:
    jaxlib = versions["jaxlib"]
    plugin, ptxas = _cuda(versions)
    missing = [d for d in (*plugin, ptxas) if versions.get(d) is None]
    if missing:
        raise ImportError(
            f"jzero.gpu_mesh compiles with XLA's GPU compiler, from JAX's CUDA plugin and "
            f"ptxas, and {', '.join(missing)} is not installed. Install the gpu-compile "
            f"extra with the plugin at jaxlib's version ({jaxlib}): {_install_hint(jaxlib)}"
        )
    wrong = {d: versions[d] for d in plugin if versions[d] != jaxlib}
    if wrong:
        found = ", ".join(f"{d} {v}" for d, v in wrong.items())
        raise ImportError(
            f"JAX's CUDA plugin does not match jaxlib {jaxlib} ({found}); JAX loads the "
            f"plugin only at jaxlib's exact version. Install the matching one: "
            f"{_install_hint(jaxlib)}"
        )


_PLATFORMS_FIX = (
    "Run JAX on the CPU: set JAX_PLATFORMS=cpu in the environment, or call "
    'jax.config.update("jax_platforms", "cpu") before JAX touches a device; the CUDA '
    "plugin still describes GPUs to compile for, beside the CPU devices."
)


def _check_platforms(platforms: str | None) -> None:
    """Refuses, before JAX starts its backends, a JAX that would start the CUDA plugin:
    without a GPU driver it fails (a cuDNN or driver error) and falls back to the CPU
    with the plugin unregistered, describing no CUDA topology."""
    names = {p.strip() for p in (platforms or "").split(",") if p.strip()}
    if not names or names & {"cuda", "gpu"}:
        raise RuntimeError(
            f"jzero.gpu_mesh describes GPUs for compiling only, with JAX running on the CPU, "
            f"but jax_platforms is {platforms!r}, so JAX would start the CUDA plugin "
            f"itself (and, without a GPU, fail and fall back to the CPU). {_PLATFORMS_FIX}"
        )
