"""Token-weighted losses: ``loss_fn`` returns a sum and a count; the step divides globally.

A loss that averages over its own slice (``jnp.mean``) gives every device the same weight,
so with padding or masks the objective depends on how tokens fall across devices and
micro-batches. Returning :class:`Weighted` instead makes the step sum ``total`` and
``count`` over devices and micro-batches first and train on ``sum(total) / sum(count)``:
the single-device objective over the global batch, whatever the split.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Weighted(NamedTuple):
    """A loss as a sum over this device's tokens (or examples) and how many there are.

    Return it from ``loss_fn`` in place of a mean loss (with ``has_aux``: ``(Weighted(...),
    aux)``). jzero sums both fields over devices and micro-batches, differentiates the sum
    and divides the gradients by the global count, so training follows ``total / count``
    of the whole batch exactly; ``metrics['loss']`` is that quotient and ``metrics['count']``
    the global count. ``count`` is not differentiated. A global count of 0 is taken as 1 (the
    loss is then the total, usually 0, and the gradients are the gradients of the total).

    A global count that is negative or not finite (NaN, inf) is a bug in ``loss_fn``
    (dividing by it would, for a negative count, *maximise* the loss), and inside ``jit``
    nothing can raise, so the step is skipped instead: parameters, optimizer state, model
    state, loss scale and ``state.step`` stay as they were; ``metrics['loss']`` is NaN,
    ``metrics['skipped']`` is 1 and ``metrics['count']`` shows the count. The train step
    then raises ``ValueError`` naming that call, at its first call after that step's result
    is ready (at the very next call in a multi-process run, which waits for it); the state
    in hand is intact, so a loop that catches the error can go on.

    Examples:
        >>> def loss_fn(params, batch):
        ...     nll_BxT = per_token_nll(params, batch)  # padding included
        ...     mask_BxT = batch["mask"]  # 1 for real tokens, 0 for padding
        ...     return jzero.Weighted(total=(nll_BxT * mask_BxT).sum(), count=mask_BxT.sum())
    """

    total: jax.Array  # () float: the sum of the per-token losses on this device's slice
    count: jax.Array  # () int or float: the number of tokens, or the sum of their weights


def check_weighted(loss: Weighted) -> Weighted:
    """``total`` a float scalar (as float32), ``count`` a real scalar (int32 or float32)."""
    total, count = jnp.asarray(loss.total), jnp.asarray(loss.count)
    if total.shape != () or not jnp.issubdtype(total.dtype, jnp.floating):
        raise TypeError(
            f"jzero.Weighted(total=...) must be a floating-point scalar, got {_describe(total)}; "
            "sum the per-token losses over the device's batch, e.g. (nll * mask).sum()."
        )
    if count.shape != () or not (
        jnp.issubdtype(count.dtype, jnp.integer) or jnp.issubdtype(count.dtype, jnp.floating)
    ):
        raise TypeError(
            f"jzero.Weighted(count=...) must be an integer or float scalar, got "
            f"{_describe(count)}; count the tokens the total sums over, e.g. mask.sum()."
        )
    kind = jnp.int32 if jnp.issubdtype(count.dtype, jnp.integer) else jnp.float32
    return Weighted(total.astype(jnp.float32), jax.lax.stop_gradient(count.astype(kind)))


def divisor(count: jax.Array) -> jax.Array:
    """The global count as float32, with 0 taken as 1."""
    count = count.astype(jnp.float32)
    return jnp.where(count == 0, jnp.float32(1), count)


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def counted(count: jax.Array) -> jax.Array:
    """Whether the global count is one to divide by: >= 0 and finite (a bool scalar)."""
    count = count.astype(jnp.float32)
    return jnp.isfinite(count) & (count >= 0)


def skip_uncounted(
    ok: jax.Array, count: jax.Array, old: Any, new: Any, metrics: dict
) -> tuple[Any, dict]:
    """The step's ``(new state, metrics)`` when ``ok`` (:func:`counted`) is False: the old
    state's step, model state and loss scale (the update itself already kept parameters,
    Optax state and master weights), the loss NaN and the step marked skipped. ``metrics``
    gets ``count`` either way."""
    keep = lambda n, o: jax.lax.select(ok, n, o)  # select keeps typed PRNG keys typed
    new = new.replace(
        step=keep(new.step, old.step),
        model_state=jax.tree.map(keep, new.model_state, old.model_state),
        loss_scale=jax.tree.map(keep, new.loss_scale, old.loss_scale),
    )
    skipped = ~ok | (metrics.get("skipped", 0) != 0)
    loss = jnp.where(ok, metrics["loss"], jnp.float32(jnp.nan))
    return new, metrics | {"loss": loss, "count": count, "skipped": skipped.astype(jnp.int32)}


class CountWatch:
    """Remembers the global count of each step a train step runs, and raises at a later
    call for one that was negative or not finite (that step skipped itself in ``jit``).

    A count is read once its step's result is ready, so watching never stalls the
    dispatch of the next step; in a multi-process run every process waits for it at the
    next call instead, so that all of them raise at the same call.
    """

    def __init__(self):
        self._calls = 0
        self._pending: list[tuple[int, jax.Array]] = []  # (call number, global count)

    def watch(self, metrics: dict) -> None:
        """Called with each step's metrics (those without a ``count`` are not watched)."""
        self._calls += 1
        if "count" in metrics:
            self._pending.append((self._calls, metrics["count"]))

    def check(self) -> None:
        """Raises ``ValueError`` for the first watched step whose count was invalid."""
        wait = jax.process_count() > 1
        while self._pending:
            call, count = self._pending[0]
            local = count.addressable_data(0)  # replicated: one value on every device
            if not (wait or local.is_ready()):
                return
            self._pending.pop(0)
            value = np.asarray(local).item()
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(_uncounted_message(call, value))


def _uncounted_message(call: int, value: float) -> str:
    return (
        f"call {call} of this train step had a global jzero.Weighted count of {value} "
        "(summed over devices and micro-batches); a count must be >= 0 and finite: the "
        "number of tokens, or the sum of their non-negative weights, e.g. mask.sum() of a "
        "0/1 mask. That step was skipped (metrics['skipped'] == 1, metrics['loss'] NaN): "
        "its parameters, optimizer state and model state are those from before it, so "
        "nothing was lost. Fix loss_fn's count=..., then go on with the state you hold."
    )


def check_delayable(ok: jax.Array | None) -> None:
    """Refuses a :class:`Weighted` loss under ``Offload(delay=1)`` (when the step is traced):
    its invalid counts skip the step they occur in, which a delayed update has already
    half taken."""
    if ok is not None:
        raise ValueError(
            "loss_fn returns a jzero.Weighted loss, whose invalid counts skip the step they "
            "occur in, but Offload(delay=1) applies each gradient one step later; return the "
            "mean loss, or use delay=0 (or exact_steps larger than the run)."
        )
