"""The benchmark's result as a text table, the design targets under it."""

from __future__ import annotations

from typing import Any

from jzero import _table

from .targets import checks


def table(result: dict[str, Any], *, quick: bool = False) -> str:
    """The runs as an aligned text table (bytes in KB = 1e3), then the design targets
    (``quick``: only those that hold at any model size, see :func:`checks`)."""
    m = result["model"]
    head = (
        f"{m['name']}: {m['params']:,} params ({m['dtype']}), {result['devices']} "
        f"{result['platform']} devices, jax {result['jax']}"
    )
    rows = [(
        "run", "states KB", "theory", "host KB", "peak KB", "device KB", "comm KB", "theory",
        "gather KB", "colls", "ms/step", "loss",
    )]  # fmt: skip
    for r in result["runs"]:
        rows.append((
            r["name"],
            f"{r['model_state_bytes_per_device'] / 1e3:,.1f}",
            f"{r['theory_model_state_bytes_per_device'] / 1e3:,.1f}",
            f"{r['host_bytes_per_device'] / 1e3:,.1f}",
            f"{r['peak_bytes_per_device'] / 1e3:,.1f}",
            f"{r['device_peak_bytes_per_device'] / 1e3:,.1f}",
            f"{r['comm_bytes_per_device']['total'] / 1e3:,.1f}",
            f"{r['theory_comm_bytes_per_device'] / 1e3:,.1f}",
            f"{r['comm_bytes_per_device']['all-gather'] / 1e3:,.1f}",
            str(r["collectives_per_step"]),
            f"{r['step_ms_median']:.1f}",
            f"{r['loss_first']:.4f} -> {r['loss_last']:.6f}",
        ))  # fmt: skip
    body = _table.table(rows, right=set(range(1, 11)))
    return "\n".join([head, body, "", *checks(result, quick=quick)])
