"""Mixed precision: parameter/compute dtype, fp32 master weights, reduce dtype, loss scaling."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..dtypes import float_dtype
from .moved import names_moved_options

_FLOATS = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _check_dtype(name: str, dtype: Any) -> np.dtype:
    example = f"Precision({name}=jnp.bfloat16)"
    return float_dtype(dtype, what=f"Precision.{name}", allowed=_FLOATS, example=example)


@names_moved_options
@dataclasses.dataclass(frozen=True)
class Precision:
    """How parameters are stored, computed with, gathered and reduced.

    Attributes:
        param_dtype: dtype of the parameters at rest, of their all-gathers and of the
            forward/backward compute: float32, bfloat16 or float16, given as a dtype
            (``jnp.bfloat16``), its name (``'bfloat16'``) or DeepSpeed's short name
            (``'bf16'``, ``'fp16'``, ``'fp32'``); anything else raises ``ValueError``.
            Anything but float32 keeps fp32 master weights in the optimizer's (sharded)
            state and casts them down after each update.
        reduce_dtype: dtype in which gradients are all-reduced / reduce-scattered (and
            accumulated across micro-batches in fp32 regardless), given as ``param_dtype``
            is. None: ``param_dtype``.
        dynamic_loss_scale: scale the loss before backward and unscale the reduced
            gradients; a step whose gradients are not finite is skipped on every device
            and the scale halved; after ``growth_interval`` good steps it doubles. None:
            on for float16, off otherwise.
        initial_loss_scale: the starting scale (a power of two).
        growth_interval: good steps between doublings of the scale.

    Examples:
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=2,
        ...                           precision=jzero.Precision(param_dtype=jnp.bfloat16))
    """

    param_dtype: Any = jnp.float32
    reduce_dtype: Any = None
    dynamic_loss_scale: bool | None = None
    initial_loss_scale: float = 2.0**15
    growth_interval: int = 2000

    def __post_init__(self):
        param = _check_dtype("param_dtype", self.param_dtype)
        reduce = param if self.reduce_dtype is None else self.reduce_dtype
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "reduce_dtype", _check_dtype("reduce_dtype", reduce))
        if self.dynamic_loss_scale is None:
            object.__setattr__(self, "dynamic_loss_scale", param == np.dtype(jnp.float16))
        if self.initial_loss_scale <= 0 or self.growth_interval < 1:
            raise ValueError(
                "Precision needs initial_loss_scale > 0 and growth_interval >= 1, got "
                f"{self.initial_loss_scale} and {self.growth_interval}."
            )

    @property
    def mixed(self) -> bool:
        """Whether fp32 master weights are kept apart from the parameters."""
        return self.param_dtype != np.dtype(jnp.float32)

    def cast(self, tree: Any, dtype: Any = None) -> Any:
        """Floating leaves of ``tree`` (arrays or shapes) to ``dtype`` (default ``param_dtype``)."""
        dtype = self.param_dtype if dtype is None else dtype

        def cast(x):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)

        return jax.tree.map(cast, tree)


class LossScale(NamedTuple):
    """Dynamic loss-scaling state (replicated)."""

    scale: jax.Array  # f32 scalar: the factor the loss is multiplied by
    good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed

    @classmethod
    def create(cls, precision: Precision) -> LossScale:
        return cls(jnp.float32(precision.initial_loss_scale), jnp.int32(0))

    def next(self, finite: jax.Array, precision: Precision) -> LossScale:
        """Halve on overflow; double after ``growth_interval`` finite steps in a row."""
        grow = finite & (self.good_steps + 1 >= precision.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2, self.scale), self.scale / 2)
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return LossScale(jnp.maximum(scale, 1.0), good.astype(jnp.int32))
