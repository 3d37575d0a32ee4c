"""Which of a :class:`jzero.ZeroConfig`'s options work in the user's own step."""

from __future__ import annotations

from ...core.options.communication import Communication
from ...core.options.step import StepOptions
from ...core.options.zero_config import ZeroConfig

OWN_STEP = "jzero.ZeroOptimizer(tx, mesh, ...).train_step(loss_fn)"


def check_user_step(config: ZeroConfig, *, what: str) -> None:
    """Raises for the options only jzero's own step carries out: it writes the collectives
    (communication), moves state to the host (offload), scales the loss and reduces the
    gradients itself (precision), and calls the loss (step options)."""
    refused = []
    if config.comm != Communication():
        refused.append(f"comm={config.comm} (jzero's own collectives)")
    if config.offload.optimizer is not None or config.offload.params:
        refused.append(f"offload={config.offload} (the host update and transfers)")
    precision = config.precision
    if precision.dynamic_loss_scale:
        refused.append("Precision(dynamic_loss_scale=True) (the step scales the loss)")
    if precision.reduce_dtype != precision.param_dtype:
        refused.append(
            f"Precision(reduce_dtype={precision.reduce_dtype.name}) (the step reduces the "
            "gradients; in your own step they are reduced in the dtype your backward gives)"
        )
    if config.step != StepOptions():
        refused.append(f"step={config.step} (options of jzero's train_step)")
    if refused:
        raise ValueError(
            f"{what} runs inside your own jit step, where the compiler places the "
            f"collectives; {'; '.join(refused)} need(s) jzero's own step: use {OWN_STEP}, "
            "or drop the option."
        )
