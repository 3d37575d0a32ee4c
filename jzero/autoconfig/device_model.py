"""The device model a step's time is predicted with, calibrated by a short measured probe.

A step is predicted to take

    flops / F  +  collectives x A  +  collective bytes / B  +  host copy bytes / H
    +  host update bytes / U

seconds per device: ``F`` the throughput of a dense matmul, ``A`` the time one collective
adds to a step whatever its size (its launch, and the devices' meeting between compute:
many small collectives cost more than one bucket of the same bytes), ``B`` the ring bytes
per second of an all-gather over the mesh's ``data`` axis at the sizes a leaf's gather has
(1-4 MB gathered), ``H`` the bytes per second of copies
between device and pinned host memory, ``U`` the bytes per second the host reads and writes
in an elementwise update, measured as the host optimizer step runs it (a host computation
on every device's shard at once, donated). The terms are added, not overlapped: a
conservative model that orders configurations by what they spend, which is what the search
needs; only ZeRO-Offload's delayed update, whose host work runs beside the next step's
device work, takes the longer of the two. :func:`calibrate` measures the rates once per
machine (a few seconds; the best of a few repeats of each probe after a warm-up).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.gpu_target.compile_only import is_compile_only
from ..internal import host_compute

_MATMUL = 512  # the probe's square matmul, per device
_SYNC_MATMUL = 128  # the compute between the latency probe's collectives, per device
_GATHER_BYTES = 2**20  # the smaller all-gather probe's gathered bytes per device
_COPY_BYTES = 2**24  # the host probes' bytes
_CHAIN = 32  # the latency probe's collectives


class DeviceModel(NamedTuple):
    """Rates of one device of a mesh (see the module's docstring for the model)."""

    flops_per_s: float  # F: dense matmul FLOPs per second
    collective_s: float  # A: seconds per collective, whatever its size
    collective_bytes_per_s: float  # B: all-gather ring bytes per second, per device
    host_copy_bytes_per_s: float  # H: device <-> pinned host bytes per second
    host_update_bytes_per_s: float  # U: bytes per second an elementwise host update touches

    def step_seconds(
        self,
        flops: float,
        collective_bytes: float,
        host_copy_bytes: float = 0.0,
        host_update_bytes: float = 0.0,
        *,
        collectives: float = 0.0,
        overlapped: bool = False,
    ) -> float:
        """The predicted seconds of one step that spends these per device; ``overlapped``:
        the host's copies and update run beside the device's work (ZeRO-Offload's delayed
        update), so the step takes the longer of the two."""
        device = (
            flops / self.flops_per_s
            + collectives * self.collective_s
            + collective_bytes / self.collective_bytes_per_s
        )
        host = (
            host_copy_bytes / self.host_copy_bytes_per_s
            + host_update_bytes / self.host_update_bytes_per_s
        )
        return max(device, host) if overlapped else device + host


def calibrate(mesh: Mesh, *, repeats: int = 3) -> DeviceModel:
    """Measures the device model's rates on ``mesh`` (its ``data`` axis for collectives).

    Raises ``ValueError`` for compile-only GPUs (:func:`jzero.gpu_mesh`), where nothing
    runs: :func:`jzero.autoconfigure` plans for them with datasheet rates."""
    if is_compile_only(mesh):
        raise ValueError(
            "calibrate measures rates by running probes on the mesh's devices, but these are "
            "compile-only GPUs (jzero.gpu_mesh), where nothing runs. jzero.autoconfigure("
            "..., mesh=mesh) or target= plans for them with datasheet rates "
            "(jzero.autoconfig.target.RATES); pass device_model=jzero.autoconfig.DeviceModel"
            "(...) to plan with your own."
        )
    return DeviceModel(
        flops_per_s=_matmul_rate(mesh, repeats),
        collective_s=_collective_time(mesh, repeats),
        collective_bytes_per_s=_gather_rate(mesh, repeats),
        host_copy_bytes_per_s=_copy_rate(mesh, repeats),
        host_update_bytes_per_s=_update_rate(mesh, repeats),
    )


def _best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn`` (after one warm-up), in seconds."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def _matmul_rate(mesh: Mesh, repeats: int) -> float:
    n = mesh.devices.size
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    a = jax.device_put(jnp.ones((n * _MATMUL, _MATMUL), jnp.float32), sharding)
    b = jnp.ones((_MATMUL, _MATMUL), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    return 2 * _MATMUL**3 / _best(lambda: matmul(a, b), repeats)


def _collective_time(mesh: Mesh, repeats: int) -> float:
    """Seconds one tiny all-reduce over ``data`` adds between dense compute, as a step's
    collectives sit: a loop of ``_CHAIN`` small matmul chains with and without one each
    (the devices must meet at each: their launch and synchronisation), the difference
    divided by their number; at least what one costs with no compute around it (the
    difference of ``_CHAIN`` chained all-reduces and one), which bounds it from below
    when a busy machine blurs the difference."""
    if mesh.shape["data"] == 1:
        return 0.0
    spec = P("data")

    def timed(n: int, sync: bool, matmul: bool) -> float:
        def body(_, x):
            x = jnp.tanh(x @ x.T @ x / _SYNC_MATMUL) if matmul else x
            return x * (1 + 1e-3 * jax.lax.psum(x[:1, :1], "data")) if sync else x

        loop = lambda x: jax.lax.fori_loop(0, n, body, x)
        fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        shape = (mesh.shape["data"] * _SYNC_MATMUL, _SYNC_MATMUL)
        x = jax.device_put(jnp.full(shape, 1 / _SYNC_MATMUL), NamedSharding(mesh, spec))
        return _best(lambda: fn(x), repeats)

    between = timed(_CHAIN, True, True) - timed(_CHAIN, False, True)
    bare = timed(1 + _CHAIN, True, False) - timed(1, True, False)
    return max(between, bare, 0.0) / _CHAIN


def _gather_rate(mesh: Mesh, repeats: int) -> float:
    """Ring bytes per second of an all-gather over ``data``, from two sizes a leaf's
    gather has (``_GATHER_BYTES``, and 4 x that, gathered per device): the difference of
    their times over the difference of their bytes (the launch cancels)."""
    n = mesh.shape["data"]
    if n == 1:
        return float("inf")  # no collective to wait for
    gather = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_gather(x, "data", tiled=True),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
            check_vma=False,
        )
    )

    def seconds(gathered: int) -> float:
        shape = (gathered // 4 // 256, 256)  # the whole gathered array, n shards of it
        shards = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P("data")))
        return _best(lambda: gather(shards), repeats)

    ring = lambda gathered: gathered * (n - 1) / n  # each device receives n-1 shards
    small, large = seconds(_GATHER_BYTES), seconds(4 * _GATHER_BYTES)
    if large <= small:  # a busy machine blurred the difference: the launch stays in
        return ring(4 * _GATHER_BYTES) / large
    return ring(3 * _GATHER_BYTES) / (large - small)


def _copy_rate(mesh: Mesh, repeats: int) -> float:
    device = mesh.devices.flat[0]
    if "pinned_host" not in [m.kind for m in device.addressable_memories()]:
        return float("inf")  # nothing can be offloaded here; the term never applies
    x = jax.device_put(jnp.ones(_COPY_BYTES // 4, jnp.float32), device)
    one = jax.sharding.Mesh(np.array([device]), ("one",))  # not SingleDeviceSharding:
    host = jax.sharding.NamedSharding(one, P(), memory_kind="pinned_host")  # jax 0.12.1
    back = jax.sharding.NamedSharding(one, P())  # deprecates it
    return 2 * _COPY_BYTES / _best(lambda: jax.device_put(jax.device_put(x, host), back), repeats)


def _update_rate(mesh: Mesh, repeats: int) -> float:
    """Bytes per second, per device, of an elementwise update as the host optimizer step
    runs it: a host computation (``compute_on``) on every device's shard of arrays in
    pinned host memory at once, donated. Where the backend has no host memory or JAX no
    ``compute_on`` of jzero's form, a NumPy update on one core (offload is refused there)."""
    device = mesh.devices.flat[0]
    if "pinned_host" not in [m.kind for m in device.addressable_memories()] or (
        host_compute.unavailable() is not None
    ):
        return _numpy_update_rate(repeats)
    host = NamedSharding(mesh, P(mesh.axis_names), memory_kind="pinned_host")
    shape = (mesh.devices.size * _COPY_BYTES // 4,)
    moment, grad = (jax.device_put(jnp.ones(shape, jnp.float32), host) for _ in range(2))
    update = host_compute.on_host(jax.jit(lambda m, g: 0.9 * m + g, donate_argnums=(0,)))
    step = jax.jit(update, donate_argnums=(0,), out_shardings=host)
    carry = [moment]

    def run():
        carry[0] = step(carry[0], grad)
        return carry[0]

    return 3 * _COPY_BYTES / _best(run, repeats)  # per device: two reads and a write


def _numpy_update_rate(repeats: int) -> float:
    a = np.ones(_COPY_BYTES // 4, np.float32)
    b = np.ones_like(a)
    out = np.empty_like(a)

    def update():
        np.multiply(a, 0.9, out=out)
        np.add(out, b, out=out)
        return out

    return 4 * _COPY_BYTES / _best(update, repeats)  # two reads and two writes
