"""Byte-level text data for the language-model example: shipped with the repo, no network.

The corpus is the public-domain King James text in ``examples/data/*.txt`` (a few KB);
tokens are bytes (vocabulary 256), so ``decode`` is UTF-8 decoding. ``split`` holds the
end of the text out of training; ``eval_windows`` tiles the held-out part for evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).parent / "data"


def load_corpus(data_dir: Path = DATA_DIR) -> np.ndarray:
    """All ``*.txt`` files in ``data_dir`` (sorted by name), joined by blank lines, as bytes."""
    texts = [p.read_bytes().strip() for p in sorted(data_dir.glob("*.txt"))]
    if not texts:
        raise FileNotFoundError(f"no *.txt files in {data_dir}; the example ships them there.")
    return np.frombuffer(b"\n\n".join(texts) + b"\n", dtype=np.uint8)


def split(corpus: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ``val_fraction`` of the bytes is held out, the rest trains.

    Deterministic and disjoint: windows drawn from ``train`` never reach the validation bytes.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    cut = len(corpus) - round(len(corpus) * val_fraction)
    return corpus[:cut], corpus[cut:]


def eval_windows(text: np.ndarray, *, seq_len: int, multiple_of: int = 1) -> dict[str, np.ndarray]:
    """``text`` tiled by consecutive windows of ``seq_len + 1`` bytes, each overlapping the next
    by one byte, so every byte after the first is a target once (the last ``(len(text) - 1) %
    seq_len`` bytes are left out). The windows are padded with copies of the first to a
    multiple of ``multiple_of`` (e.g. the device count) and weighted 1 (real) or 0 (padding):
    {"tokens": int32[N, seq_len + 1], "weight": float32[N]}.
    """
    n = (len(text) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(text)} bytes are too few for one window of seq_len={seq_len} + 1.")
    pad = -n % multiple_of
    starts_N = np.arange(n + pad) * seq_len
    starts_N[n:] = 0
    tokens_NxTp1 = text[starts_N[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    weight_N = (np.arange(n + pad) < n).astype(np.float32)
    return {"tokens": tokens_NxTp1, "weight": weight_N}


def batches(
    corpus: np.ndarray, *, batch_size: int, seq_len: int, seed: int
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``seq_len + 1`` bytes: {"tokens": int32[batch_size, seq_len+1]}.

    Deterministic per ``seed``. Inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.
    """
    if len(corpus) < seq_len + 2:
        raise ValueError(f"corpus has {len(corpus)} bytes, too few for seq_len={seq_len}.")
    rng = np.random.default_rng(seed)
    offsets_T = np.arange(seq_len + 1)
    while True:
        starts_B = rng.integers(0, len(corpus) - seq_len - 1, size=batch_size)
        tokens_BxTp1 = corpus[starts_B[:, None] + offsets_T[None, :]].astype(np.int32)
        yield {"tokens": tokens_BxTp1}


def decode(tokens: np.ndarray) -> str:
    """Bytes -> text (invalid UTF-8 sequences become U+FFFD)."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
