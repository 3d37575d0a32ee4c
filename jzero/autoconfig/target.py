"""A cluster the user does not have, for :func:`jzero.autoconfigure`'s ``target=`` (or a
``mesh=`` of compile-only GPUs).

``"h100:64"`` (64 H100s, 8 per host) or ``"h200:8x8"`` (8 hosts of 8), spelled as
:func:`jzero.gpu_mesh` spells them, names compile-only GPUs. XLA's GPU compiler then
decides what fits: each candidate is compiled for them. What the compiler cannot say
comes from here:

- the device budget: the spec's device memory times the share JAX's GPU allocator takes by
  default (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75; set it to plan for another), the
  ``bytes_limit`` a real run's :func:`~jzero.autoconfig.search.default_device_budget` reads;
- the rates the search orders candidates by (:class:`DeviceModel`): the vendor's dense
  16-bit tensor throughput, NVLink within a host and one InfiniBand port per GPU across
  hosts (:data:`RATES`). Datasheet peaks, not measurements: they order candidates, the
  compiled memory decides what fits. Pass ``device_model=`` to plan with your own.

Offload is not planned: compile-only devices drop host memory kinds, so no host figure
read from them would be true.
"""

from __future__ import annotations

import os
from typing import Any

from jax.sharding import Mesh

from ..core.gpu_target import gpu_mesh
from ..core.gpu_target.cluster import Cluster, gpu_names, parse_cluster
from ..core.gpu_target.compile_only import is_compile_only
from ..core.gpu_target.topology import device_memory_size
from .device_model import DeviceModel

DEFAULT_MEM_FRACTION = 0.75  # JAX's GPU allocator's default share of device memory
COLLECTIVE_S = 2e-5  # what one NCCL collective adds to a step, whatever its size

RATES = {  # name: (dense 16-bit tensor FLOP/s, NVLink bytes/s per direction, IB bytes/s)
    "v100": (125e12, 150e9, 12.5e9),  # NVLink 2 (300 GB/s), EDR 100 Gb/s
    "v100-16gb": (125e12, 150e9, 12.5e9),
    "a100": (312e12, 300e9, 25e9),  # NVLink 3 (600 GB/s), HDR 200 Gb/s
    "h100": (989e12, 450e9, 50e9),  # NVLink 4 (900 GB/s), NDR 400 Gb/s
    "h200": (989e12, 450e9, 50e9),
    "b200": (2250e12, 900e9, 50e9),  # NVLink 5 (1.8 TB/s), NDR 400 Gb/s
}
"""Datasheet peaks per GPU (NVIDIA's V100, A100, H100/H200 and B200 datasheets), and the
usual InfiniBand port of each generation's servers."""

OFFLOAD_NOTE = (
    "offload not considered: compile-only GPUs drop host memory kinds, so no offloaded "
    "figure read from them would be true; measure offload on the GPUs"
)


def parse_target(target: str) -> Cluster:
    """The cluster a ``target=`` string names, as :func:`jzero.gpu_mesh` reads it:
    ``"h100:64"`` -> 64 H100s in hosts of 8 (up to 8: one host); ``"h200:8x8"`` -> 8 hosts
    of 8 H200s; ``"a100"`` -> 8 A100s on one host."""
    return parse_cluster(target)


def target_mesh(target: Any) -> tuple[Mesh, Cluster]:
    """The compile-only mesh for ``target`` (a string, or a :func:`jzero.gpu_mesh` mesh)."""
    if isinstance(target, Mesh):
        if not is_compile_only(target):
            raise ValueError(
                "target= takes compile-only GPUs (jzero.gpu_mesh(...)) or a string such as "
                "'h100:64'; for the devices present pass mesh= instead."
            )
        device = target.devices.flat[0]
        hosts = len({d.process_index for d in target.devices.flat})
        gpu = _gpu_of(device.device_kind)
        return target, Cluster(gpu, hosts, target.devices.size)
    spec = parse_target(target)
    return gpu_mesh(spec.name), spec


def _gpu_of(kind: str) -> str:
    """The spec name of a compile-only device's ``device_kind`` (e.g. "NVIDIA H100 80GB
    HBM3" -> "h100")."""
    lowered = kind.lower()
    found = [g for g in gpu_names() if g.split("-")[0] in lowered]
    if "16gb" in lowered and "v100-16gb" in found:
        return "v100-16gb"
    if not found:
        raise ValueError(
            f"target= got a mesh of {kind!r}, which no spec names; build it with "
            f"jzero.gpu_mesh(gpu, ...) for one of {', '.join(gpu_names())}."
        )
    return found[0]


def target_budget(target: Cluster) -> float:
    """The bytes a step may use on one of ``target``'s GPUs: its memory times the share
    JAX's allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75)."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return device_memory_size(target.gpu) * fraction


def target_model(target: Cluster) -> DeviceModel:
    """The rates of :data:`RATES` for ``target``: NVLink's on one host, across hosts the
    InfiniBand port's (a ring over hosts runs at its slowest link)."""
    flops, nvlink, infiniband = RATES[target.gpu]
    link = nvlink if target.hosts == 1 else infiniband
    inf = float("inf")  # no offload is planned: its terms never apply
    return DeviceModel(flops, COLLECTIVE_S, link, inf, inf)
