"""Memory and communication estimates for ZeRO stages 0-3 (pure Python, no JAX).

Model-state bytes per device follow the ZeRO paper (Rajbhandari et al. 2019, Table 1).
With Ψ parameters, N data-parallel devices and K bytes of optimizer state per parameter,
mixed precision (16-bit params and grads) gives::

    stage 0: (2 + 2 + K)·Ψ        stage 2: 2Ψ + (2 + K)·Ψ/N
    stage 1: 2Ψ + 2Ψ + K·Ψ/N      stage 3: (2 + 2 + K)·Ψ/N

and fp32 training replaces each 2 by 4. GB means 10^9 bytes throughout.

Hybrid sharding (HSDP: model states sharded within groups of G devices, replicated
across the R = N/G groups) is the same table with N replaced by G (``shard_group=G``).

Optimizer offload (ZeRO-Offload, stages 1-3) moves the K·Ψ/N optimizer bytes to host
memory. Streamed (``offload="stream"``, or its shorthand ``"optimizer"``), the device keeps
the two pieces streaming through it: a leaf's state, cut into chunks of at most
C = ``offload_chunk`` elements when its update is elementwise (Adam, AdamW, SGD), so at
most 2·K·min(Ψ_layer, C)/N. With the step on the host (``offload="host"``) the device
keeps no optimizer bytes.

Parameter offload (ZeRO-Infinity's ``offload_param``, ``offload_params=True``, stage 3)
moves the parameter shards (2Ψ/N mixed, 4Ψ/N fp32) and, in mixed precision with the
optimizer on the device, the fp32 master weights (4Ψ/N) to host memory; the device keeps
copies of the shards of the layers being gathered (one layer, two with prefetch). The
device update copies the master weights in, so K·Ψ/N stays in the device's count.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal

Stage = Literal[0, 1, 2, 3]
Precision = Literal["mixed", "fp32"]
Offload = Literal[None, "optimizer", "stream", "host"]
STAGES: tuple[Stage, ...] = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
# Default K (optimizer bytes per parameter, Adam). mixed: fp32 master copy + two fp32
# moments = 12. fp32: the parameters are already the fp32 master, so two moments = 8.
DEFAULT_K = {"mixed": 12, "fp32": 8}
_PARAM_BYTES = {"mixed": 2, "fp32": 4}  # bytes per parameter of params, and of grads
OFFLOAD_CHUNK = 2**24  # ZeroOptimizer's default offload_chunk (jzero.core.plan)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device for one ZeRO stage (floats: Ψ/N need not be whole).

    Every field but ``host_bytes`` is device memory; ``total_bytes`` is the device's.
    """

    stage: int
    params_bytes: float  # parameters held: full copy, or a 1/N shard at stage 3
    grads_bytes: float  # gradients held: full, or a 1/N shard at stages 2-3
    optimizer_bytes: float  # K·Ψ, or 1/N at stages 1-3; streamed: 2 chunks'; host step: 0
    gathered_layer_bytes: float  # stage 3: the largest layer's params, gathered in full
    activation_bytes: float  # as given (see `transformer_activation_bytes`)
    buffer_bytes: float  # communication buffers, as given
    host_bytes: float = 0.0  # offloaded: optimizer state K·Ψ/N (+ param shards), else 0
    secondary_bytes: float = 0.0  # stage 3 with hpZ: the secondary copies, Ψ·bytes/G_hpz

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        extra = self.gathered_layer_bytes + self.activation_bytes + self.buffer_bytes
        return self.model_state_bytes + extra + self.secondary_bytes

    def to_dict(self) -> dict[str, float]:
        """All fields plus `model_state_bytes` and `total_bytes`, for JSON."""
        d = dataclasses.asdict(self)
        return d | {"model_state_bytes": self.model_state_bytes, "total_bytes": self.total_bytes}


def _check_stage(stage: Any) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"stage must be 0, 1, 2 or 3, got {stage!r}: use 0 (plain data parallel), "
            "1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)."
        )


def _check_ints(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{name} must be an integer >= 1, got {value!r}: pass a whole count, e.g. {name}=8."
            )


def _check_nonneg(**values: Any) -> None:
    for name, value in values.items():
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}: e.g. 7.5e9.")


def _shard_group(devices: int, shard_group: Any) -> int:
    """G: the devices model states are sharded over (N unless hybrid); it must divide N."""
    if shard_group is None:
        return devices
    _check_ints(shard_group=shard_group)
    if devices % shard_group:
        raise ValueError(
            f"shard_group must divide devices: {shard_group} does not divide {devices}. "
            "Hybrid sharding shards within groups of G devices and replicates across the "
            f"N/G groups; use a divisor of {devices}, e.g. the devices per host."
        )
    return int(shard_group)


def _resolve_k(precision: Any, k: float | None) -> float:
    if precision not in DEFAULT_K:
        raise ValueError(
            f"precision must be 'mixed' or 'fp32', got {precision!r}: use 'mixed' for 16-bit "
            "params/grads with an fp32 master copy, 'fp32' for full precision."
        )
    k = DEFAULT_K[precision] if k is None else k
    _check_nonneg(k=k)
    return k


def _state_bytes(
    params: float, devices: int, stage: int, param_b: float, grad_b: float, opt_b: float
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes; opt state sharded from stage 1, grads 2, params 3."""
    shard = lambda b, sharded_from: b * params / (devices if stage >= sharded_from else 1)
    return shard(param_b, 3), shard(grad_b, 2), shard(opt_b, 1)


def theory_model_state_bytes(
    *,
    params: float,
    devices: int,
    stage: Stage,
    param_bytes: float,
    grad_bytes: float,
    opt_bytes: float,
) -> float:
    """Model-state bytes per device of docs/design.md §1, for any bytes per parameter.

    Stage s shards the optimizer state (s >= 1), gradients (s >= 2) and parameters (s = 3)
    over the N devices; the rest is replicated.

    Args:
        params: parameter count Ψ.
        devices: data-parallel degree N.
        stage: ZeRO stage, 0 to 3.
        param_bytes, grad_bytes, opt_bytes: bytes per parameter of the parameters, the
            gradients and the optimizer state (e.g. 4, 4, 8 for fp32 Adam).
    """
    _check_stage(stage)
    _check_ints(devices=devices)
    _check_nonneg(
        params=params, param_bytes=param_bytes, grad_bytes=grad_bytes, opt_bytes=opt_bytes
    )
    return float(sum(_state_bytes(params, devices, stage, param_bytes, grad_bytes, opt_bytes)))


def theory_comm_bytes(*, stage: Stage, param_bytes_S: float, devices: int) -> float:
    """Bytes each device sends per step in the ring model (docs/design.md §1).

    Stages 0-2 move 2·S·(N−1)/N (an all-reduce, or a reduce-scatter plus an all-gather);
    stage 3 moves 3·S·(N−1)/N (params gathered in forward and again in backward, grads
    reduce-scattered). S is the bytes of one full copy of the parameters in the
    collective's dtype.
    """
    _check_stage(stage)
    _check_ints(devices=devices)
    _check_nonneg(param_bytes_S=param_bytes_S)
    return (3 if stage == 3 else 2) * param_bytes_S * (devices - 1) / devices


def theory_comm_bytes_per_axis(
    *, stage: Stage, param_bytes_S: float, devices: int, replicas: int
) -> dict[str, float]:
    """Bytes each device sends per step over each mesh axis with hybrid sharding (ring model).

    ``devices`` is the data-group size G (model states sharded over it) and ``replicas``
    the number R of groups. Over 'data' a step moves what :func:`theory_comm_bytes` says
    with N = G; over 'replica' each device all-reduces what its group left it: its 1/G
    gradient shard at stages 1-3, 2·(S/G)·(R−1)/R, the whole gradient at stage 0,
    2·S·(R−1)/R.
    """
    _check_ints(replicas=replicas)
    data = theory_comm_bytes(stage=stage, param_bytes_S=param_bytes_S, devices=devices)
    held = param_bytes_S / (devices if stage >= 1 else 1)
    return {"data": data, "replica": 2 * held * (replicas - 1) / replicas}


ACROSS, WITHIN = "data(across)", "data(within)"
"""hpZ's two parts of the 'data' axis: across its groups of G devices, and within one."""


def theory_comm_bytes_hpz(
    *, param_bytes_S: float, devices: int, group: int, replicas: int = 1
) -> dict[str, float]:
    """Bytes each device sends per stage-3 step with hpZ (``Communication(hpz=group)``), by
    part of the mesh (ring model; :mod:`jzero.core.comm.hpz`).

    ``devices`` is the data axis size N, cut into N/G groups of ``group`` = G devices.
    Forward gathers the parameters across the groups into 1/G secondary copies,
    ``S·(N/G−1)/N`` (:data:`ACROSS`), then each gather and backward's re-gather run within
    the group, ``2·S·(G−1)/G`` (:data:`WITHIN`); the gradients are reduce-scattered over
    the whole data axis, ``S·(N−1)/N`` (``'data'``); with ``replicas`` R > 1 the shards
    are all-reduced across them, ``2·(S/N)·(R−1)/R`` (``'replica'``).
    """
    _check_ints(devices=devices, group=group, replicas=replicas)
    _check_nonneg(param_bytes_S=param_bytes_S)
    if devices % group:
        raise ValueError(f"group={group} must divide devices={devices}.")
    s, n = param_bytes_S, devices
    out = {ACROSS: s * (n // group - 1) / n, WITHIN: 2 * s * (group - 1) / group}
    out["data"] = s * (n - 1) / n
    if replicas > 1:
        out["replica"] = 2 * (s / n) * (replicas - 1) / replicas
    return out


def transformer_activation_bytes(
    *,
    batch: int,
    seq: int,
    hidden: int,
    layers: int,
    heads: int | None = None,
    checkpointing: bool = False,
    model_parallel: int = 1,
) -> float:
    """Activation bytes per device of a transformer with 16-bit activations.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models"): one layer stores about 34·b·s·h bytes, plus 5·a·s²·b for the attention
    scores, softmax output and dropout mask when the a heads' s×s scores are stored.
    Without checkpointing all L layers are kept: L·(34·b·s·h + 5·a·s²·b). With full
    activation checkpointing only each layer's input is kept (2·b·s·h bytes) plus one
    layer's full activations while it is recomputed: L·2·b·s·h + 34·b·s·h + 5·a·s²·b.

    Args:
        batch: micro-batch size b per data-parallel device.
        seq: sequence length s.
        hidden: hidden size h.
        layers: number of layers L.
        heads: attention heads a; None leaves out the 5·a·s²·b term (right for fused
            attention kernels that never store the s×s scores).
        checkpointing: full activation checkpointing (recompute each layer in backward).
        model_parallel: tensor-parallel degree M, assumed with sequence parallelism,
            which divides every term by M.
    """
    _check_ints(batch=batch, seq=seq, hidden=hidden, layers=layers, model_parallel=model_parallel)
    if heads is not None:
        _check_ints(heads=heads)
    layer = 34 * batch * seq * hidden + (5 * heads * seq**2 * batch if heads else 0)
    kept = layers * 2 * batch * seq * hidden + layer if checkpointing else layers * layer
    return kept / model_parallel


def estimate(
    *,
    params: float,
    devices: int,
    stage: Stage,
    k: float | None = None,
    precision: Precision = "mixed",
    model_parallel: int = 1,
    largest_layer_params: float = 0.0,
    prefetch: bool = False,
    activation_bytes: float = 0.0,
    buffer_bytes: float = 0.0,
    shard_group: int | None = None,
    offload: Offload = None,
    offload_chunk: int = OFFLOAD_CHUNK,
    offload_params: bool = False,
    offload_ratio: float = 1.0,
    hpz: int | None = None,
) -> Estimate:
    """Memory per device of one ZeRO stage.

    Args:
        params: parameter count Ψ of the whole model.
        devices: data-parallel degree N.
        stage: ZeRO stage, 0 to 3.
        k: optimizer bytes per parameter; default 12 for "mixed" (fp32 master + two Adam
            moments) and 8 for "fp32" (two moments; the params are the master copy).
        precision: "mixed" (2-byte params and grads) or "fp32" (4-byte params and grads).
        model_parallel: tensor/model-parallel degree M; Ψ is divided by M first.
        largest_layer_params: parameter count of the largest layer. Stage 3 holds it
            gathered in full (in the param dtype, divided by M) while it computes.
        prefetch: stage 3 gathers the next layer while computing this one: doubles the
            gathered-layer term.
        activation_bytes: activation bytes per device, e.g. from
            `transformer_activation_bytes`; added as given.
        buffer_bytes: communication buffers per device, e.g. a fused bucket's elements
            times bytes per element; added as given.
        shard_group: hybrid sharding (HSDP): model states are sharded within groups of
            this many devices G and replicated across the N/G groups, so the stage
            formulas hold with N replaced by G. G must divide N; default N (plain ZeRO).
        offload: where the optimizer state rests and is updated (``jzero.Offload``'s
            ``optimizer``; stages 1-3). ``"host"``: the state (K·Ψ/N) is in ``host_bytes``
            and the device holds none of it. ``"stream"`` (or ``"optimizer"``, its
            shorthand): it is in ``host_bytes``; the device holds two pieces of it while
            they stream through:
            ``2·K·min(largest_layer_params, offload_chunk)/N``. A piece is one parameter
            leaf's state, cut into chunks of at most ``offload_chunk`` elements when the
            update is elementwise (Adam, AdamW, SGD); a non-elementwise update
            (Adafactor) of a leaf stacking several layers (``nn.scan``) streams the
            whole leaf, more than this.
        offload_chunk: ``jzero.Offload(chunk=...)``, elements per streamed chunk.
        offload_params: ``jzero.Offload(params=True)`` (stage 3): the parameter shards
            (and, in mixed precision with the optimizer on the device, the fp32 master
            weights) are in ``host_bytes``; the device keeps the gathered layers' shards.
        offload_ratio: ``jzero.Offload(ratio=r)``: the share r of the optimizer state
            (K·Ψ/N) in ``host_bytes``; the rest stays in ``optimizer_bytes`` (a streamed
            mode's two pieces too: they may come from either side). Taken exactly here;
            jzero splits by whole leaves.
        hpz: stage 3 with ``Communication(hpz=G)``: forward keeps each parameter gathered
            over groups of G devices for backward, ``secondary_bytes`` = Ψ·bytes/G (in
            the param dtype, divided by M). G must divide the data group.

    Examples:
        >>> round(estimate(params=7.5e9, devices=64, stage=1).total_bytes / 1e9, 1)
        31.4
    """
    _check_stage(stage)
    _check_ints(devices=devices, model_parallel=model_parallel, offload_chunk=offload_chunk)
    _check_nonneg(params=params, activation_bytes=activation_bytes, buffer_bytes=buffer_bytes)
    _check_nonneg(largest_layer_params=largest_layer_params)
    group = _shard_group(devices, shard_group)
    k = _resolve_k(precision, k)
    pb = _PARAM_BYTES[precision]
    states = _state_bytes(params / model_parallel, group, stage, pb, pb, k)
    gathered = (2 if prefetch else 1) * pb * largest_layer_params / model_parallel
    gathered = gathered if stage == 3 and group > 1 else 0.0
    params_b, grads_b, optimizer_b = states
    host = 0.0
    mode = _check_offload(offload, offload_params, stage)
    _check_ratio(offload_ratio, mode)
    if mode is not None:
        host, kept = offload_ratio * optimizer_b, (1 - offload_ratio) * optimizer_b
        piece = min(largest_layer_params, offload_chunk)
        optimizer_b = kept + (2 * k * piece / model_parallel / group if mode == "stream" else 0.0)
    if offload_params:
        layers = (2 if prefetch else 1) * largest_layer_params
        fraction = min(layers / params, 1.0) if params else 0.0
        # an offloaded optimizer's host bytes (K) hold the master weights already
        master_b = 4 * params / model_parallel / group if precision == "mixed" else 0.0
        params_b, more = params_b * fraction, params_b + (master_b if mode is None else 0.0)
        host += more
    extra = (gathered, float(activation_bytes), float(buffer_bytes), host)
    secondary = _secondary_bytes(hpz, stage, group, pb * params / model_parallel)
    return Estimate(stage, params_b, grads_b, optimizer_b, *extra, secondary)


def _secondary_bytes(hpz: int | None, stage: int, group: int, param_bytes: float) -> float:
    """hpZ's secondary copies: 1/G of the parameters' bytes, kept from forward to backward."""
    if hpz is None or stage != 3:
        return 0.0
    _check_ints(hpz=hpz)
    if group % hpz:
        raise ValueError(f"hpz={hpz} must divide the data group of {group} devices.")
    return param_bytes / hpz


def _check_offload(offload: Any, offload_params: Any, stage: int) -> str | None:
    """The optimizer offload mode (``"stream"``, ``"host"``) or None; raises on bad input."""
    if offload not in (None, "optimizer", "stream", "host"):
        raise ValueError(
            f"offload must be None, 'stream' (or 'optimizer'), or 'host', got {offload!r}."
        )
    if offload is not None and stage == 0:
        raise ValueError(
            f"offload={offload!r} needs stage >= 1 (stage 0 does not shard the optimizer "
            "state, and jzero does not offload it); use stage=1, 2 or 3."
        )
    if not isinstance(offload_params, bool):
        raise ValueError(f"offload_params must be True or False, got {offload_params!r}.")
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params=True needs stage 3 (stage {stage} keeps whole parameters on "
            "every device); use stage=3, or offload_params=False."
        )
    return "stream" if offload == "optimizer" else offload


def _check_ratio(ratio: Any, mode: str | None) -> None:
    ok = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1
    if not ok:
        raise ValueError(f"offload_ratio must be a number in (0, 1], got {ratio!r}.")
    if ratio != 1 and mode is None:
        raise ValueError(
            f"offload_ratio={ratio!r} is the share of an offloaded optimizer state, but "
            "offload=None offloads none; pass offload='host' (or 'stream')."
        )


def stage_table(**kwargs: Any) -> tuple[Estimate, ...]:
    """`estimate` for stages 0, 1, 2 and 3, with the same keyword arguments but `stage`."""
    return tuple(estimate(stage=stage, **kwargs) for stage in STAGES)


def max_params(
    *,
    device_memory: float,
    devices: int,
    stage: Stage,
    largest_layer_fraction: float = 0.0,
    **kwargs: Any,
) -> int:
    """Largest parameter count Ψ whose `estimate(...).total_bytes` fits in `device_memory`.

    Everything but Ψ is held fixed; the total is affine in Ψ, and the result satisfies
    `estimate(Ψ) <= device_memory < estimate(Ψ + 1)` exactly. Returns 0 if nothing fits.

    Args:
        device_memory: bytes per device, e.g. 80e9 (the command line's
            `jzero.cli.units.parse_bytes` reads "80GB" or "80GiB").
        devices: data-parallel degree N.
        stage: ZeRO stage, 0 to 3.
        largest_layer_fraction: the largest layer as a fraction of Ψ (0 to 1), added to a
            fixed `largest_layer_params` count if one is given.
        **kwargs: the other keyword arguments of `estimate` (k, precision, ...).
    """
    if isinstance(device_memory, str):
        raise ValueError(
            f"device_memory must be a number of bytes, got the string {device_memory!r}: "
            "pass e.g. 80e9, or convert it with jzero.cli.units.parse_bytes(...)."
        )
    _check_nonneg(device_memory=device_memory, largest_layer_fraction=largest_layer_fraction)
    if largest_layer_fraction > 1:
        raise ValueError(
            f"largest_layer_fraction must be at most 1, got {largest_layer_fraction}: "
            "give the largest layer's share of all parameters, e.g. 0.02."
        )
    fixed = kwargs.pop("largest_layer_params", 0.0)

    def total(psi: float, constants: bool = True) -> float:
        layer = largest_layer_fraction * psi + (fixed if constants else 0.0)
        extra = {} if constants else {"activation_bytes": 0.0, "buffer_bytes": 0.0}
        e = estimate(
            params=psi, devices=devices, stage=stage, largest_layer_params=layer, **(kwargs | extra)
        )
        return e.total_bytes

    base = total(0)
    if base > device_memory:
        return 0
    psi = int((device_memory - base) / total(1, constants=False))
    while psi > 0 and total(psi) > device_memory:  # correct float rounding, in steps of one
        psi -= 1
    while total(psi + 1) <= device_memory:
        psi += 1
    return psi
