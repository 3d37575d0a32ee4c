"""The ZeRO paper's Figure 1 for one model: model states per device vs N, stages 0-3.

:func:`plot_model_states` draws the theory (``jzero.estimate``) and, optionally, measured
points, e.g. those :func:`read_measured` takes from a ``scripts/bench.py --json`` file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ..accounting.estimate import DEFAULT_K, STAGE_NAMES, STAGES, Precision, estimate
from .units import format_params

_JZERO_RUNS = ("dp", "zero1", "zero2", "zero3")  # benchmark runs that are jzero stages 0-3


def read_measured(path: str) -> dict[int, list[tuple[int, float]]]:
    """``{stage: [(N, bytes)]}`` from a benchmark JSON (docs/design.md §5); jzero runs only.

    Raises:
        ValueError: ``path`` cannot be read, or is not a benchmark JSON.
    """
    try:
        with open(path) as f:
            bench = json.load(f)
        out: dict[int, list[tuple[int, float]]] = {}
        for run in bench["runs"]:
            if run["name"] in _JZERO_RUNS:
                point = (bench["devices"], float(run["model_state_bytes_per_device"]))
                out.setdefault(run["stage"], []).append(point)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a benchmark JSON ({type(e).__name__}: {e}); write one with "
            "python scripts/bench.py --json PATH."
        ) from None
    return out


def plot_model_states(
    path: str,
    *,
    params: float,
    devices: Sequence[int] = tuple(2**i for i in range(11)),
    k: float | None = None,
    precision: Precision = "mixed",
    model_parallel: int = 1,
    measured: Mapping[int, Sequence[tuple[int, float]]] | None = None,
) -> None:
    """Writes a PNG of model-state bytes per device vs N for stages 0-3 (ZeRO Figure 1).

    Args:
        path: output file, e.g. "memory.png".
        params, k, precision, model_parallel: as in `jzero.estimate`.
        devices: data-parallel degrees on the (log2) x axis.
        measured: optional measurements to overlay as markers, {stage: [(N, bytes), ...]}.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``measured`` has a stage other than 0-3, or an argument of
            `jzero.estimate` is out of range.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_model_states needs matplotlib: pip install 'jzero[examples]'"
        ) from e
    measured = dict(measured or {})
    if bad := [stage for stage in measured if stage not in STAGES]:
        raise ValueError(
            f"measured has stages {bad}: key the measurements by ZeRO stage 0, 1, 2 or 3."
        )
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    opts = dict(params=params, k=k, precision=precision, model_parallel=model_parallel)
    for stage in STAGES:
        gb = [estimate(devices=n, stage=stage, **opts).model_state_bytes / 1e9 for n in devices]
        (line,) = ax.plot(devices, gb, label=f"stage {stage} ({STAGE_NAMES[stage]})")
        if measured.get(stage):
            xs, ys = zip(*measured[stage], strict=True)
            label = f"stage {stage} measured"
            ax.plot(xs, [y / 1e9 for y in ys], "o", color=line.get_color(), label=label)
    k_shown = DEFAULT_K.get(precision) if k is None else k
    ax.set(
        yscale="log",
        xlabel="data-parallel devices N",
        ylabel="model states per device (GB)",
        title=f"Ψ = {format_params(params)}, K = {k_shown:g}, {precision}, M = {model_parallel}",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(devices), [str(n) for n in devices])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
