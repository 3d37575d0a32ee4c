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
from .moved import names_moved_options

HOST = "pinned_host"
"""The memory kind an offloaded leaf is stored in (ZeRO-Offload: the optimizer's leaves)."""
DEFAULT_OFFLOAD_CHUNK = 2**24
"""Elements per chunk an offloaded elementwise update streams through the device."""
OPTIMIZER_MODES = (None, "stream", "host")
DEFAULT_EXACT_STEPS = 40
"""Exact steps before ``Offload(delay=1)`` 's delayed update starts, unless given."""


@names_moved_options
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
        ratio: the share of the optimizer state that rests in host memory (DeepSpeed's
            ``offload_optimizer.ratio``, ZeRO-Offload++'s Twin-Flow), in (0, 1]: the
            parameter leaves, in the order of the flattened tree, whose running total of
            elements is nearest ``ratio`` of all have their Optax state and master weights
            on the host (updated there, or streamed); every other leaf's stay on the device
            and are updated there, in the same step. The split is by whole leaves
            (:func:`offloaded_leaves`), so a model of few large leaves gets a coarse one
            (``opt.plan(params).describe()`` shows where each leaf rests). 1 (default):
            everything. Needs ``optimizer``.
        delay: 1: ZeRO-Offload's delayed parameter update (DPU), with ``optimizer="host"``.
            After ``exact_steps`` exact steps, each step applies the gradient of the step
            before it, so the host's update does not wait for this step's backward pass
            and may run while the device computes it: step k's parameters are step k-1's
            updated with the gradient taken at step k-2's. The first delayed step applies
            no update (there is no earlier gradient yet); the gradient held between steps
            is part of the state (``ZeroState.pending``, in host memory) and of its
            checkpoints. 0 (default): every step exact.
        exact_steps: with ``delay=1``, how many steps run exactly before the delay starts
            (the ZeRO-Offload paper turns it on only after the early iterations, when the
            gradients change fastest).

    Examples:
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=2, offload=jzero.Offload(optimizer="host"))
    """

    optimizer: Literal["stream", "host"] | None = None
    params: bool = False
    chunk: int | None = None
    ratio: float = 1.0
    delay: int = 0
    exact_steps: int = DEFAULT_EXACT_STEPS

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
        _check_ratio(self.ratio, self.optimizer)
        _check_delay(self.delay, self.exact_steps, self.optimizer)

    def __repr__(self) -> str:  # as a user writes it: the fields that differ from defaults
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"Offload({', '.join(given)})"

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

    def check_precision(self, precision: Any) -> None:
        """Raises where the delayed update cannot keep ``precision``'s promises."""
        if self.delay and precision.dynamic_loss_scale:
            raise ValueError(
                "Offload(delay=1) applies each gradient one step late, but dynamic loss "
                "scaling (fp16 parameters) decides per step whether to apply one, which "
                "jzero does not carry across the delay; use bf16 or fp32 parameters "
                "(Precision(param_dtype=jnp.bfloat16)), or delay=0."
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


def _check_ratio(ratio: Any, optimizer: str | None) -> None:
    ok = isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
    if not ok or not 0 < ratio <= 1:
        raise ValueError(
            f"Offload.ratio must be a number in (0, 1], the share of the optimizer state in "
            f"host memory, got {ratio!r}; e.g. Offload(optimizer='host', ratio=0.5)."
        )
    if ratio != 1 and optimizer is None:
        raise ValueError(
            f"Offload(ratio={ratio!r}) sets the share of the optimizer state in host memory, "
            "but optimizer=None offloads none of it; pass optimizer='host' (or 'stream'), or "
            "leave ratio out."
        )


def _check_delay(delay: Any, exact_steps: Any, optimizer: str | None) -> None:
    if isinstance(delay, bool) or delay not in (0, 1):
        raise ValueError(
            f"Offload.delay must be 0 (every step exact) or 1 (ZeRO-Offload's delayed "
            f"parameter update), got {delay!r}; e.g. Offload(optimizer='host', delay=1)."
        )
    if delay and optimizer != "host":
        raise ValueError(
            f"Offload(delay=1) overlaps the host's update with the device's next step, but "
            f"optimizer={optimizer!r} does not update on the host; pass optimizer='host'."
        )
    if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 0:
        raise ValueError(
            f"Offload.exact_steps must be an int >= 0 (steps run exactly before the delayed "
            f"update starts), got {exact_steps!r}; e.g. Offload(optimizer='host', delay=1, "
            "exact_steps=40)."
        )
    if exact_steps != DEFAULT_EXACT_STEPS and not delay:
        raise ValueError(
            f"Offload(exact_steps={exact_steps!r}) says when the delayed update starts, but "
            "delay=0 delays nothing; pass delay=1, or leave exact_steps out."
        )


def offloaded_leaves(sizes: list[int], ratio: float) -> list[bool]:
    """Which of the parameter leaves of ``sizes`` elements (in tree order) have their
    optimizer state offloaded at ``ratio``: the prefix whose total is nearest ``ratio`` of
    all (a leaf goes to the host when the running total at its middle is within the
    share), so ratio 1 offloads every leaf and the host share is within half the largest
    leaf of ``ratio``."""
    total, before, chosen = sum(sizes), 0, []
    for size in sizes:
        chosen.append(ratio == 1 or before + size / 2 < ratio * total)
        before += size
    return chosen


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
