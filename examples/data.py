"""Byte-level text data for the language-model example: shipped with the repo, no network.

The corpus is the public-domain King James text in ``examples/data/*.txt`` (a few KB);
tokens are bytes (vocabulary 256), so ``decode`` is UTF-8 decoding.
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
