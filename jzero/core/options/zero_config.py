"""A run's configuration, as one frozen object: :class:`ZeroConfig`.

It composes the option classes beside it -- :class:`.layout.Layout`,
:class:`.precision.Precision`, :class:`.communication.Communication`,
:class:`.offload.Offload` and :class:`.step.StepOptions` -- with the ZeRO stage, and checks
them against each other once, when it is built. What needs a mesh (hpZ's group size, the
backend's host memory, the rules' axes) is checked by :meth:`ZeroConfig.check`, which the
optimizer calls with its mesh. Everything downstream -- the plan, the step, the Flax train
states, the DeepSpeed reader -- reads this object, never loose copies of its parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from jax.sharding import Mesh

from ..mesh import check_mesh
from .communication import Communication
from .layout import Layout
from .moved import names_moved_options, refuse_moved
from .offload import Offload, as_offload
from .precision import Precision
from .step import StepOptions

Stage = Literal[0, 1, 2, 3]

KEYWORDS = ("stage", "param_specs", "rules", "min_shard_size", "precision", "comm", "offload")
"""The configuration's fields as the optimizer and the Flax train states take them by name."""


@names_moved_options
@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Everything a ZeRO run is configured with, apart from the model, ``tx`` and the mesh.

    Attributes:
        stage: 0 (plain data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
            3 (+ parameters).
        layout: a :class:`jzero.Layout`: ``param_specs``, ``rules`` and ``min_shard_size``
            (default: every non-scalar leaf sharded over ``data`` alone).
        precision: a :class:`jzero.Precision` (default: everything float32).
        comm: a :class:`jzero.Communication` (default: exact, one collective per leaf).
        offload: a :class:`jzero.Offload`, or ``"optimizer"`` for ``Offload(optimizer=
            "stream")`` (default: everything on the device).
        step: the :class:`jzero.StepOptions` every ``train_step`` starts from (its
            keyword arguments replace fields of it).

    None for any option is its default. Built, it is checked once: each option against the
    stage (e.g. ``Communication(gather_quant='int8')`` needs stage 3). Immutable: derive a
    variant with ``dataclasses.replace(config, stage=2)``, which checks it again.

    Examples:
        >>> config = jzero.ZeroConfig(stage=3, precision=jzero.Precision(param_dtype="bf16"),
        ...                           offload=jzero.Offload(optimizer="host"))
        >>> opt = jzero.ZeroOptimizer(optax.adamw(3e-4), mesh, config=config)
    """

    stage: Stage
    layout: Layout = Layout()
    precision: Precision = Precision()
    comm: Communication = Communication()
    offload: Offload = Offload()
    step: StepOptions = StepOptions()

    def __post_init__(self):
        stage = self.stage
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in get_args(Stage):
            raise ValueError(
                f"stage must be 0, 1, 2 or 3, got {stage!r}: 0 = plain data parallel, "
                "1 = shard optimizer state, 2 = + gradients, 3 = + parameters."
            )
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("offload", as_offload(self.offload))
        for name, cls in _OPTIONS.items():
            value = getattr(self, name)
            if value is None:
                set_(name, cls())
            elif not isinstance(value, cls):
                raise TypeError(
                    f"{name} must be a jzero.{cls.__name__}, got {type(value).__name__}; e.g. "
                    f"{name}=jzero.{cls.__name__}(), or None for its default."
                )
        self.comm.check_stage(stage)
        self.offload.check_stage(stage)
        self.offload.check_precision(self.precision)
        self.step.check_stage(stage)

    @property
    def partitions_opt_state(self) -> bool:
        """Stage >= 1 (P_os): the optimizer state and master weights are 1/N shards."""
        return self.stage >= 1

    @property
    def partitions_grads(self) -> bool:
        """Stage >= 2 (P_g): gradients are reduce-scattered during backward, never whole."""
        return self.stage >= 2

    @property
    def partitions_params(self) -> bool:
        """Stage 3 (P_p): parameters at rest are 1/N shards, gathered where used."""
        return self.stage == 3

    def check(self, mesh: Mesh) -> int:
        """Raises where ``mesh`` cannot run this configuration: hpZ's group size, the
        backend's host memory for offload, axes the rules name. Returns the size of the
        mesh's ``data`` axis."""
        data_size = check_mesh(mesh)
        self.layout.check(mesh)
        self.comm.check_data_size(data_size)
        self.offload.check_backend(mesh)
        return data_size

    def with_step(self, step: StepOptions) -> ZeroConfig:
        """This configuration with the step options ``step`` (checked against the stage)."""
        return self if step == self.step else dataclasses.replace(self, step=step)


_OPTIONS = {
    "layout": Layout,
    "precision": Precision,
    "comm": Communication,
    "offload": Offload,
    "step": StepOptions,
}


def zero_config(config: ZeroConfig | None, keywords: dict[str, Any], *, what: str) -> ZeroConfig:
    """``config``, or the keyword options (:data:`KEYWORDS`) gathered into one; never both.
    ``what`` names the caller in the errors, e.g. ``"ZeroOptimizer"``."""
    refuse_moved(what, keywords, KEYWORDS)
    unknown = sorted(keywords.keys() - set(KEYWORDS))
    if unknown:
        raise TypeError(
            f"{what} got unexpected keyword arguments {unknown}; its configuration takes "
            f"{', '.join(KEYWORDS)} (or config=jzero.ZeroConfig(...))."
        )
    if config is not None:
        if keywords:
            raise TypeError(
                f"{what} got config= and the options {sorted(keywords)} besides; give one of "
                f"them: dataclasses.replace(config, ...) for a variant of a config."
            )
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a jzero.ZeroConfig, got {type(config).__name__}.")
        return config
    if "stage" not in keywords:
        raise TypeError(f"{what} needs stage= (0, 1, 2 or 3), or config=jzero.ZeroConfig(...).")
    keywords, names = dict(keywords), ("param_specs", "rules", "min_shard_size")
    layout = Layout(**{k: keywords.pop(k) for k in names if k in keywords})
    return ZeroConfig(layout=layout, **keywords)
