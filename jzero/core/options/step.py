"""What one training step does with the loss it is given: one frozen object.

``ZeroOptimizer.train_step(loss_fn, options)`` (or its keyword arguments, gathered into a
:class:`StepOptions` on entry) hands this object on unchanged: the step builder, the
shard_map body and both Flax adapters read their fields from it, so a new option is one
field here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .moved import names_moved_options, refuse_moved


@names_moved_options
@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How ``train_step`` calls the loss, and what it keeps.

    Attributes:
        manual_gather: if False (default), stage 3 gathers each parameter where the loss
            first uses it, one layer at a time inside scans and checkpointed layers
            (:mod:`jzero.core.gather.autogather`). If True, ``loss_fn`` receives
            :class:`jzero.Sharded` handles in stages 2/3 and calls :func:`jzero.gather` on
            each layer's parameters where it uses them, inside a rematerialised layer
            (``jax.checkpoint`` / ``nn.remat``), so stage 3 holds about one layer's gathered
            parameters at a time and backward gathers again. Call ``gather`` once per
            parameter and forward pass: each call is one reduce-scatter of that parameter's
            gradient in backward (stages 2/3).
        grad_accum: split each device's batch into this many micro-batches and accumulate
            their gradients in fp32 inside the step (``lax.scan``). Stages 0/1 keep a
            full-size local accumulator and communicate once per step; stages 2/3 keep only
            their 1/N shard and reduce-scatter every micro-batch.
        with_model_state: the loss also reads and updates non-trainable model state
            (``state.model_state``, e.g. Flax ``batch_stats``), replicated over 'data':
            ``loss_fn(params, model_state, batch) -> (loss, new_model_state)`` (with
            ``has_aux``: ``((loss, aux), new_model_state)``). jzero then makes the new state
            agree on every device (mean of floats, max of integers).
        has_aux: ``loss_fn`` returns ``(loss, aux)``, as for ``jax.value_and_grad(...,
            has_aux=True)``; ``metrics['aux']`` holds aux averaged over devices and
            micro-batches (floats; integers are summed, e.g. token counts).
        donate: donate the old state's buffers to the new one (a consumed state is then
            refused by every entry point, not reused).
        per_device_rng: typed PRNG keys in the model state (``jax.random.key``; an NNX
            ``RngStream``'s key) are folded with the device's index along the batch axes
            before ``loss_fn`` sees them, so devices draw independently (e.g. dropout
            masks); the state written back is the same on every device (the unfolded key
            if ``loss_fn`` left it as it got it, else device 0's). False: every device
            gets the same key.
        axis_name: the model's own name(s) for the batch axis, e.g. ``'batch'`` for a
            Flax ``nn.BatchNorm(axis_name='batch')``: collectives over it run over the
            batch axes (``'data'``; ``('replica', 'data')`` when hybrid), so synchronised
            statistics are those of the global batch. A collective over an axis that is
            neither a mesh axis nor an alias raises ``ValueError`` naming it. An axis the
            loss binds itself (``jax.vmap(..., axis_name='batch')``) needs no alias.
        remat_policy: what stage 3's default gathering (``manual_gather=False``) lets
            backward keep of each layer: each step of a scan over stacked layers,
            prefetched or not (``Communication(prefetch=...)``), and each repeated layer of
            an unrolled model (parameter subtrees named ``blocks_0``, ``blocks_1``, ... as
            Flax Linen names submodules, or a list / ``nnx.List`` of layers, read one
            after another; no ``layers=`` needed). None (default): every activation, as
            FSDP does; backward gathers the layer's parameters again and recomputes
            nothing. A ``jax.checkpoint_policies`` policy keeps only what it saves and
            recomputes the rest in backward, layer by layer, e.g.
            ``jax.checkpoint_policies.nothing_saveable``: each layer's forward again from
            its input (more FLOPs, less activation memory). A gathered parameter is never
            kept, whatever the policy. A loss with neither (no scan, no checkpoint, no
            repeated layers) gets a warning. Stage 3 without ``manual_gather`` only (with
            ``manual_gather``, give the policy to :func:`jzero.remat_layer`).

    Examples:
        >>> step = opt.train_step(loss_fn, jzero.StepOptions(has_aux=True, grad_accum=4))
        >>> step = opt.train_step(loss_fn, has_aux=True, grad_accum=4)  # the same
    """

    manual_gather: bool = False
    grad_accum: int = 1
    with_model_state: bool = False
    has_aux: bool = False
    donate: bool = True
    per_device_rng: bool = True
    axis_name: str | tuple[str, ...] | None = None
    remat_policy: Callable[..., Any] | None = None

    def __post_init__(self):
        accum = self.grad_accum
        if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
            raise ValueError(f"grad_accum must be a positive int, got {accum!r}.")
        for name in ("manual_gather", "with_model_state", "has_aux", "donate", "per_device_rng"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"StepOptions.{name} must be True or False, got {getattr(self, name)!r}."
                )
        if self.remat_policy is not None and not callable(self.remat_policy):
            raise TypeError(
                f"StepOptions.remat_policy must be None (keep every activation) or a "
                f"jax.checkpoint_policies policy, got {self.remat_policy!r}; e.g. "
                "remat_policy=jax.checkpoint_policies.nothing_saveable."
            )
        if isinstance(self.axis_name, list):  # hashable, as a frozen option must be
            object.__setattr__(self, "axis_name", tuple(self.axis_name))

    def check_stage(self, stage: int) -> None:
        """Raises where an option has nothing to act on at ``stage`` (when the step is built)."""
        if self.remat_policy is None:
            return
        if stage != 3 or self.manual_gather:
            where = f"stage {stage}" if stage != 3 else "manual_gather=True"
            fix = (
                "use stage=3"
                if stage != 3
                else "pass the policy to jzero.remat_layer(fn, policy=...)"
            )
            raise ValueError(
                f"StepOptions(remat_policy={self.remat_policy!r}) chooses what stage 3's default "
                f"gathering keeps for backward, but {where} has none; {fix}, or leave "
                "remat_policy=None."
            )


def step_options(
    options: StepOptions | None, kwargs: dict, default: StepOptions | None = None
) -> StepOptions:
    """``options``; or ``default`` (the run's, :class:`StepOptions` () without one) with the
    keyword arguments replacing its fields; never both."""
    default = StepOptions() if default is None else default
    if options is None:
        fields = {f.name for f in dataclasses.fields(StepOptions)}
        refuse_moved("train_step", kwargs, fields)
        unknown = sorted(kwargs.keys() - fields)
        if unknown:
            raise TypeError(f"train_step got unknown options {_names(unknown)}.")
        return dataclasses.replace(default, **kwargs) if kwargs else default
    if not isinstance(options, StepOptions):
        raise TypeError(
            f"train_step's options must be a jzero.StepOptions, got "
            f"{type(options).__name__}; e.g. jzero.StepOptions(has_aux=True)."
        )
    if kwargs:
        raise TypeError(
            f"train_step got both a StepOptions and keyword options {_names(kwargs)}; put "
            f"them in the StepOptions: dataclasses.replace(options, {next(iter(kwargs))}=...)."
        )
    return options


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)
