"""Byte-level text data for the language-model example: shipped with the repo, no network.

The corpus is the complete King James Bible (public domain; 4.3 MB of text,
``examples/data/kjv.txt.xz``, built from Debian's ``bible-kjv-text`` package: see
``examples/data/README.md``): one verse per line (``1:1 In the beginning ...``), each book
after its name. Tokens are bytes (vocabulary 256), so ``decode`` is UTF-8 decoding.
``split`` holds whole chapters out of training; ``eval_windows`` cuts the held-out text
into windows for evaluation; ``batches`` draws random training windows.
"""

from __future__ import annotations

import functools
import lzma
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).parent / "data" / "kjv.txt.xz"
# A chapter begins at its first verse ("12:1 "), or at its book's name when it is the
# book's first chapter ("Exodus\n\n1:1 ").
_CHAPTER_START = re.compile(rb"^(?:[^\n]+\n\n)?\d+:1 ", re.M)


@functools.cache
def load_corpus(path: Path = CORPUS) -> np.ndarray:
    """The text of the xz-compressed file ``path`` as bytes: ``uint8[n]``, read-only."""
    try:
        text = lzma.decompress(Path(path).read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: the example ships it in examples/data/ (restore it with "
            "`git checkout examples/data`, or rebuild it with examples/data/make_kjv.py)"
        ) from None
    return np.frombuffer(text, dtype=np.uint8)


def chapter_starts(corpus: np.ndarray) -> np.ndarray:
    """Byte offsets where each chapter begins (the first is 0): ``int64[chapters]``."""
    starts = [m.start() for m in _CHAPTER_START.finditer(corpus.tobytes())]
    if not starts or starts[0] != 0:
        raise ValueError("the text does not start with a chapter ('Book\\n\\n1:1 ...')")
    return np.array(starts, dtype=np.int64)


def held_out_chapters(n_chapters: int, val_fraction: float) -> np.ndarray:
    """Which of ``n_chapters`` chapters are held out: ``bool[n_chapters]``, a
    ``val_fraction`` share of them spread evenly (0.1: the 10th, 20th, ... chapter)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    edges = np.floor(np.arange(n_chapters + 1) * val_fraction + 1e-9)
    return np.diff(edges) > 0


def split(corpus: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): whole chapters, a ``val_fraction`` share of them spread evenly
    through the text (:func:`held_out_chapters`), are held out; the rest, in order, trains.

    Disjoint by construction: every byte of ``corpus`` is in exactly one of the two, so no
    training window reaches into a held-out chapter (only across the seam where one was
    taken out).
    """
    starts = chapter_starts(corpus)
    held = held_out_chapters(len(starts), val_fraction)
    if not held.any():
        raise ValueError(
            f"val_fraction {val_fraction:g} holds out none of the {len(starts):,} chapters; "
            f"use at least 1/{len(starts)} = {1 / len(starts):.2g}"
        )
    if held.all():
        raise ValueError(f"val_fraction {val_fraction:g} holds out every chapter; use less")
    ends = np.append(starts[1:], len(corpus))
    part = lambda keep: np.concatenate(
        [corpus[s:e] for s, e, k in zip(starts, ends, keep, strict=True) if k]
    )
    return part(~held), part(held)


def eval_windows(
    text: np.ndarray, *, seq_len: int, multiple_of: int = 1, count: int | None = None
) -> dict[str, np.ndarray]:
    """Windows of ``seq_len + 1`` bytes of ``text`` to score, fixed for the whole run.

    ``count=None``: ``text`` tiled by consecutive windows, each overlapping the next by one
    byte, so every byte after the first is a target once (the last ``(len(text) - 1) %
    seq_len`` bytes are left out). ``count=N`` (fewer than the tiling's): ``N`` windows
    spread evenly over ``text``, the first at its start and the last at its end. The windows
    are padded with copies of the first to a multiple of ``multiple_of`` (e.g. the device
    count) and weighted 1 (real) or 0 (padding):
    {"tokens": int32[N, seq_len + 1], "weight": float32[N]}.
    """
    n = (len(text) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(text)} bytes are too few for one window of seq_len={seq_len} + 1.")
    if count is not None and count < 1:
        raise ValueError(f"count must be a positive number of windows, got {count}.")
    starts = np.arange(n) * seq_len
    if count is not None and count < n:
        n, starts = count, np.linspace(0, len(text) - seq_len - 1, count).round().astype(int)
    pad = -n % multiple_of
    starts_N = np.concatenate([starts, np.zeros(pad, dtype=starts.dtype)])
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
