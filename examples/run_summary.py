"""What the main job (``train_lm.py``) says about a run: its description, the loss lines,
the plot, the sample's overlap with the training text, and the figures of summary.json."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
from overlap import Span, longest_shared_span
from progress import trend

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def json_float(x: float) -> float | str:
    """``x`` for JSON, which has no NaN or infinity: those become "nan", "inf", "-inf"
    (``float`` reads them back). Finite floats round-trip exactly."""
    return x if math.isfinite(x) else str(x)


def loss_figures(losses: list[float], val_losses: list[tuple[int, float]]) -> dict:
    """The curves' figures for summary.json: first and last training loss, every
    evaluation ``[step, loss]``, the final and the lowest validation loss and their ratio."""
    best_step, best = min(val_losses, key=lambda sv: sv[1])
    final = val_losses[-1][1]
    return {
        "train_loss_first": json_float(losses[0]) if losses else None,
        "train_loss_last": json_float(losses[-1]) if losses else None,
        "val_losses": [[s, json_float(v)] for s, v in val_losses],
        "val_loss_final": json_float(final),
        "val_loss_min": json_float(best),
        "val_loss_min_step": best_step,
        "val_final_over_min": json_float(final / best),
    }


def loss_lines(losses: list[float], val_losses: list[tuple[int, float]]) -> list[str]:
    """Whether the training and the validation loss fell, in two lines."""
    (_, first), (_, final) = val_losses[0], val_losses[-1]
    best_step, best = min(val_losses, key=lambda sv: sv[1])
    val = (
        f"{trend('validation loss', first, final)} (held-out chapters); lowest {best:.4f} "
        f"after {best_step} steps; final/lowest {final / best:.3f}"
    )
    if not losses:
        return [val]
    return [f"{trend('loss', losses[0], losses[-1])} (training batches)", val]


def plot_curves(
    path: Path,
    losses: list[float],
    val_losses: list[tuple[int, float]],
    *,
    resumed: int | None,
    title: str,
) -> None:
    """``path``: the training loss per step and the validation loss per evaluation."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(losses, lw=0.6, alpha=0.7, label="training (each step's batch)")
    ax.plot(*zip(*val_losses), "o-", ms=3, label="validation (held-out chapters)")
    best_step, best = min(val_losses, key=lambda sv: sv[1])
    ax.axhline(best, ls="--", lw=0.6, c="gray")
    where = {"xycoords": ("axes fraction", "data"), "textcoords": "offset points"}
    ax.annotate(f"lowest {best:.3f} (step {best_step})", (0, best), (4, 4), fontsize=8, **where)
    if resumed is not None:
        ax.axvline(resumed, ls=":", lw=0.8, c="gray", label=f"resumed at step {resumed}")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
    ax.title.set_fontsize(10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shared_spans(
    sample: np.ndarray, train_text: np.ndarray, val_text: np.ndarray, *, passages: int = 5
) -> tuple[Span, list[int]]:
    """The longest span ``sample`` (bytes) shares with ``train_text``, and for comparison the
    lengths of the longest spans that ``passages`` stretches of held-out text, as long as
    the sample and spread evenly through ``val_text``, share with it: text the model never
    saw that repeats the training text that much, not memorisation."""
    train = train_text.tobytes()
    span = longest_shared_span(sample.tobytes(), train)
    n = min(len(sample), len(val_text))
    starts = np.linspace(0, len(val_text) - n, passages).round().astype(int)
    held_out = [longest_shared_span(val_text[s : s + n].tobytes(), train).length for s in starts]
    return span, held_out


def throughput(step_seconds: list[float], tokens_per_step: int) -> float | None:
    """Training tokens per second over ``step_seconds`` but the first (which compiles);
    None with fewer than two steps."""
    timed = step_seconds[1:]
    return tokens_per_step * len(timed) / sum(timed) if timed else None
