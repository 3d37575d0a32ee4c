"""Checks that a state's leaves rest in the memory its plan stores them in (device, or
pinned host memory for an offloaded optimizer), and that the step's offload matches the
state's. jzero never moves a state between memories by itself."""

from __future__ import annotations

from typing import Any

import jax

from .options.offload import HOST, NO_OFFLOAD, Offload
from .plan import Stored, ZeroState


def check_state_offload(state: ZeroState, offload: Offload) -> None:
    """``state`` was made by an optimizer with this ``offload`` (the step's check; export
    and inspection read placement from the state's plan and take either)."""
    if state.plan.config.offload != offload:
        raise ValueError(
            f"state was made by an optimizer with offload="
            f"{_spelled(state.plan.config.offload)}, but "
            f"this optimizer has offload={_spelled(offload)}; create the state with this "
            "optimizer's init(), or move it "
            "over with a checkpoint: jzero.Checkpointer.restore(opt, ...) places every leaf "
            "where this optimizer's plan says."
        )


def check_memory(state: ZeroState) -> None:
    """Every leaf of ``state`` is in the memory its plan stores it in: the optimizer state
    and master weights in host memory when offloaded, everything else on the device.

    jzero never moves a state between memories by itself: a leaf moved by hand (e.g.
    ``jax.device_put`` after a restore) would otherwise be moved back silently by the step,
    or fail inside XLA with a memory-space mismatch.
    """
    plan = state.plan
    fields = [("params", state.params, plan.params), ("opt_state", state.opt_state, plan.opt)]
    if plan.master is not None:
        fields.append(("master", state.master, plan.master))
    fields += [(f, getattr(state, f), None) for f in ("step", "model_state", "loss_scale")]
    for field, tree, stored in fields:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, x), s in zip(leaves, stored or [None] * len(leaves)):
            got, want = _memory(x), _kind(s)
            if got is None or got == want:
                continue
            how = _offloaded(plan.config.offload)
            raise ValueError(
                f"state.{field} leaf {jax.tree_util.keystr(path)} is in {got!r} memory, but "
                f"its plan stores it in {want!r} memory: {how}. jzero does not move a state "
                "between memories by itself. Put the leaf back, e.g. jax.device_put(x, "
                f"x.sharding.with_memory_kind({want!r})), or restore the state with "
                "jzero.Checkpointer.restore(opt, ...), which places every leaf as planned."
            )


def _offloaded(offload: Offload) -> str:
    """What ``offload`` keeps in host memory, for messages."""
    if offload == NO_OFFLOAD:
        return "nothing is offloaded (offload=None)"
    what = [
        *(["the optimizer's leaves"] if offload.optimizer is not None else []),
        *(["stage 3's sharded parameters and their master weights"] if offload.params else []),
    ]
    return f"{' and '.join(what)} rest in host memory (offload={_spelled(offload)})"


def _spelled(offload: Offload) -> str:
    """``offload`` as a user writes it: None, ``'optimizer'`` (its shorthand) or the object."""
    if offload == NO_OFFLOAD:
        return "None"
    return "'optimizer'" if offload == Offload(optimizer="stream") else repr(offload)


def _kind(stored: Stored | None) -> str:
    """The memory kind a leaf is stored in: ``HOST`` or the device's own (``"device"``)."""
    return HOST if stored is not None and stored.memory_kind == HOST else "device"


def _memory(x: Any) -> str | None:
    """``x``'s memory kind, ``HOST`` or ``"device"``: from its sharding when concrete, from
    its abstract value's memory space when traced; None when it has neither (numpy)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        kind = x.sharding.memory_kind
        return "device" if kind is None else kind
    space = getattr(jax.typeof(x), "memory_space", None) if isinstance(x, jax.Array) else None
    if space is None:
        return None
    return HOST if space == jax.memory.Space.Host else "device"
