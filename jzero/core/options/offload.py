"""What is offloaded to host memory, as one option object: :class:`Offload`.

Given once, in the run's :class:`jzero.ZeroConfig` (or as ``ZeroOptimizer(...,
offload=jzero.Offload(...))``), which checks it against its stage when it is built
(:meth:`Offload.check_stage`) and the optimizer against its backend's memory kinds
(:meth:`Offload.check_backend`). ``offload="optimizer"`` is the shorthand for
``Offload(optimizer="stream")``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from ...internal import host_compute

HOST = "pinned_host"
"""The memory kind an offloaded leaf is stored in (ZeRO-Offload: the optimizer's leaves)."""
DEFAULT_OFFLOAD_CHUNK = 2**24
"""Elements per chunk an offloaded elementwise update streams through the device."""
OPTIMIZER_MODES = (None, "stream", "host")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offload:
    """Which model states rest in pinned host memory, and where the optimizer step runs.

    Attributes:
        optimizer: ``"stream"``: the sharded Optax state and fp32 master weights rest in
            host memory and each step streams them through the device, one parameter leaf
            (or chunk) at a time, and updates them there (:mod:`jzero.core.offload.update`).
            ``"host"``: they rest in host memory and the update runs on the host
            (ZeRO-Offload as DeepSpeed runs it; :mod:`jzero.core.offload.host_step`): the
            gradient shards go down in the reduce dtype and the new parameters come up in
            the parameter dtype, so the device holds neither the state nor the master
            weights and does no optimizer work. None (default): on the device. Stages 1-3.
        params: stage 3's parameter shards rest in pinned host memory too, and are brought
            to the device where they are gathered. Needs stage 3.
        chunk: with ``optimizer="stream"``, the most elements of one parameter leaf whose
            state streams through the device at once (DeepSpeed's ``sub_group_size``): an
            elementwise update (Adam, AdamW, SGD, a global-norm clip) of a larger leaf runs
            on chunks of it, cut along an axis no mesh axis shards
            (:mod:`jzero.core.offload.chunks`). None: ``2**24``.

    Examples:
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=2, offload=jzero.Offload(optimizer="host"))
    """

    optimizer: Literal["stream", "host"] | None = None
    params: bool = False
    chunk: int | None = None

    def __post_init__(self):
        if not (self.optimizer is None or isinstance(self.optimizer, str)) or (
            self.optimizer not in OPTIMIZER_MODES
        ):
            raise ValueError(
                "Offload.optimizer must be None, 'stream' (the state streams through the "
                "device, which updates it) or 'host' (the update runs on the host), got "
                f"{self.optimizer!r}; e.g. Offload(optimizer='host')."
            )
        if not isinstance(self.params, bool):
            raise TypeError(f"Offload.params must be True or False, got {self.params!r}.")
        _check_chunk(self.chunk, self.optimizer)

    @property
    def stream_chunk(self) -> int | None:
        """Elements per streamed chunk with ``optimizer="stream"``; None otherwise."""
        if self.optimizer != "stream":
            return None
        return DEFAULT_OFFLOAD_CHUNK if self.chunk is None else self.chunk

    @property
    def offloads(self) -> bool:
        """Whether anything rests in host memory."""
        return self.optimizer is not None or self.params

    def check_stage(self, stage: int) -> None:
        """Raises where ``stage`` cannot do what is asked (when the configuration is built)."""
        if self.optimizer is not None and stage == 0:
            raise ValueError(
                f"Offload(optimizer={self.optimizer!r}) needs stage >= 1: at stage 0 every "
                "device holds the whole optimizer state, which ZeRO-Offload does not move; "
                "use stage=1, 2 or 3."
            )
        if self.params and stage != 3:
            raise ValueError(
                f"Offload(params=True) keeps stage 3's parameter shards in host memory, but "
                f"stage {stage} stores whole parameters on every device; use stage=3, or "
                "leave params=False."
            )

    def check_backend(self, mesh: jax.sharding.Mesh) -> None:
        """Raises where the mesh's backend (or this JAX) cannot do what is asked (when the
        optimizer is built, before anything is traced)."""
        if self.offloads:
            _check_host_memory(mesh, self)
        if self.optimizer == "host":
            _check_host_compute()


def _check_chunk(chunk: Any, optimizer: str | None) -> None:
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(
            f"Offload.chunk must be a positive int (elements per streamed chunk), got "
            f"{chunk!r}; e.g. Offload(optimizer='stream', chunk=2**24)."
        )
    if optimizer != "stream":
        raise ValueError(
            f"Offload(chunk={chunk!r}) bounds the optimizer state streamed through the "
            f"device, which only optimizer='stream' does (optimizer={optimizer!r}); pass "
            "optimizer='stream', or leave chunk out."
        )


def _check_host_memory(mesh: jax.sharding.Mesh, offload: Offload) -> None:
    device = mesh.devices.flat[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST not in kinds:
        raise ValueError(
            f"{offload} needs host memory ({HOST!r}), but the {device.platform} backend's "
            f"devices offer only {kinds}; use offload=None on this backend."
        )


def _check_host_compute() -> None:
    reason = host_compute.unavailable()
    if reason is not None:
        raise RuntimeError(
            f"Offload(optimizer='host') runs the update as a host computation, which JAX "
            f"{jax.__version__} cannot express the way jzero does: {reason}. Use "
            "Offload(optimizer='stream') (the same state in host memory, updated on the "
            "device), or install a JAX that jzero supports (pyproject.toml's range)."
        )


def as_offload(offload: Any) -> Offload:
    """``offload=`` as an :class:`Offload`: None, the shorthand ``"optimizer"``
    (``Offload(optimizer="stream")``) or an ``Offload``."""
    if offload is None:
        return Offload()
    if isinstance(offload, Offload):
        return offload
    if isinstance(offload, str) and offload == "optimizer":
        return Offload(optimizer="stream")
    raise ValueError(
        f"offload must be None, 'optimizer' (short for jzero.Offload(optimizer='stream')) or "
        f"a jzero.Offload, got {offload!r}; e.g. offload=jzero.Offload(optimizer='host')."
    )


NO_OFFLOAD = Offload()
"""Nothing offloaded: every model state on the device."""
