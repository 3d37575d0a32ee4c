"""Mixed precision: parameter/compute dtype, fp32 master weights, reduce dtype, loss scaling."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .comm.quantize import GATHER_QUANTS, GRAD_QUANTS, Quant
from .dtypes import float_dtype

_FLOATS = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _check_dtype(name: str, dtype: Any) -> np.dtype:
    example = f"Precision({name}=jnp.bfloat16)"
    return float_dtype(dtype, what=f"Precision.{name}", allowed=_FLOATS, example=example)


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
        gather_quant: ``'int8'``: stage 3 all-gathers its parameters as int8 with one
            fp32 scale per block of ``quant_block`` elements (ZeRO++'s qwZ, about 0.254x
            fp32's bytes, 0.508x bf16's; :mod:`jzero.core.comm.quantize`); each element is
            off by at most absmax/254 of its block. ``'fp8'``: the same bytes, as
            float8_e4m3fn with ``scale = absmax / 448`` per block; each element is off by
            at most ``max(|x| / 16, absmax / 458752)`` (e4m3's 3 mantissa bits: a relative
            error, lower than int8's where a block holds outliers, about 4x higher on
            Gaussian weights). Gradients are those at the dequantized parameters,
            reduce-scattered unquantized in ``reduce_dtype``. None: gathered exactly.
            Only stage 3 gathers parameters; other stages refuse it.
        grad_quant: ``'int8'`` or ``'int4'``: stages 1-3 reduce-scatter their gradients
            quantized (ZeRO++'s qgZ): each device quantizes the part of its gradient each
            other device owns, with one fp32 scale per block of ``quant_block`` elements,
            sends it in one all-to-all, and the owner dequantizes and sums the N parts in
            fp32 (:mod:`jzero.core.comm.quantize`). Each device's contribution is off by at most
            absmax/254 (int8) or absmax/14 (int4) of its block. None: reduced exactly in
            ``reduce_dtype``. Stage 0 (all-reduce) refuses it.
        quant_block: elements per fp32 scale of a quantized gather or reduce-scatter (a
            positive int; even for ``grad_quant='int4'``, which packs two values a byte).

    Examples:
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=2,
        ...                           precision=jzero.Precision(param_dtype=jnp.bfloat16))
        >>> opt = jzero.ZeroOptimizer(tx, mesh, stage=3,
        ...                           precision=jzero.Precision(gather_quant='int8'))
    """

    param_dtype: Any = jnp.float32
    reduce_dtype: Any = None
    dynamic_loss_scale: bool | None = None
    initial_loss_scale: float = 2.0**15
    growth_interval: int = 2000
    gather_quant: Literal["int8", "fp8"] | None = None
    grad_quant: Literal["int8", "int4"] | None = None
    quant_block: int = 256

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
        quant = self.gather_quant  # a str: a dtype such as np.dtype('int8') equals 'int8'
        if quant is not None and (not isinstance(quant, str) or quant not in GATHER_QUANTS):
            raise ValueError(
                "Precision.gather_quant must be None, 'int8' or 'fp8' (float8_e4m3fn), "
                f"got {self.gather_quant!r}; e.g. Precision(gather_quant='fp8')."
            )
        if self.grad_quant is not None and self.grad_quant not in GRAD_QUANTS:
            allowed = " or ".join(repr(q) for q in GRAD_QUANTS)
            raise ValueError(
                f"Precision.grad_quant must be None or {allowed}, got {self.grad_quant!r}; "
                "e.g. Precision(grad_quant='int8')."
            )
        block = self.quant_block
        if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
            raise ValueError(
                f"Precision.quant_block must be a positive int (elements per fp32 scale), "
                f"got {block!r}; e.g. Precision(gather_quant='int8', quant_block=256)."
            )
        if self.grad_quant == "int4" and block % 2:
            raise ValueError(
                f"Precision.quant_block must be even with grad_quant='int4' (two 4-bit "
                f"values share a byte), got {block}; e.g. quant_block=256."
            )
        object.__setattr__(self, "quant_block", int(block))

    @property
    def mixed(self) -> bool:
        """Whether fp32 master weights are kept apart from the parameters."""
        return self.param_dtype != np.dtype(jnp.float32)

    @property
    def gather_quantizer(self) -> Quant | None:
        """How stage 3's parameter all-gathers are quantized; None: they are exact."""
        if self.gather_quant is None:
            return None
        return Quant(self.gather_quant, self.quant_block)

    @property
    def grad_quantizer(self) -> Quant | None:
        """How gradient reduce-scatters are quantized; None: they are exact."""
        if self.grad_quant is None:
            return None
        return Quant(self.grad_quant, self.quant_block)

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
