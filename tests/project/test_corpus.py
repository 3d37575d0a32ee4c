"""The main job's corpus (examples/data.py): the whole King James Bible, whole chapters held
out, fixed validation windows; and the sample-overlap measure (examples/overlap.py)."""

import itertools
import lzma
import re
import sys

import numpy as np
import pytest
from _paths import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
import data  # noqa: E402
import overlap  # noqa: E402


def test_corpus_is_the_whole_king_james_bible():
    corpus = data.load_corpus()
    text = corpus.tobytes()
    assert len(text) == 4_304_247 >= 2**20  # 4.3 MB, from 972 KB compressed
    assert data.CORPUS.stat().st_size < 1_000_000
    assert text.isascii()
    assert text.startswith(
        b"Genesis\n\n1:1 In the beginning God created the heaven and the earth.\n"
    )
    assert text.endswith(b"22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n")
    lines = text.decode().split("\n")
    verse = re.compile(r"\d+:\d+ \S")
    headings = [line for line in lines if line and not verse.match(line)]
    assert len(headings) == 66 and headings[:2] == ["Genesis", "Exodus"]
    assert headings[-1] == "Revelation" and "1 Samuel" in headings
    assert sum(bool(verse.match(line)) for line in lines) == 31_102
    assert len(data.chapter_starts(corpus)) == 1_189


def test_held_out_chapters_are_spread_evenly():
    assert np.flatnonzero(data.held_out_chapters(40, 0.1)).tolist() == [9, 19, 29, 39]
    assert np.flatnonzero(data.held_out_chapters(10, 0.25)).tolist() == [3, 7]
    assert data.held_out_chapters(1189, 0.1).sum() == 118
    assert data.held_out_chapters(1189, 0.07).sum() == 83  # floor(1189 x 0.07)


def test_split_holds_out_whole_chapters_disjoint_from_training():
    corpus = data.load_corpus()
    train, val = data.split(corpus, 0.1)
    assert (len(train), len(val)) == (3_889_040, 415_207)
    # Every byte in exactly one part: walking the chapters in order and taking each from
    # the part it belongs to rebuilds the corpus, and uses up both parts.
    starts = data.chapter_starts(corpus)
    sizes = np.diff(np.append(starts, len(corpus)))
    held = data.held_out_chapters(len(starts), 0.1)
    parts, taken = {False: train, True: val}, {False: 0, True: 0}
    rebuilt = []
    for size, h in zip(sizes, held, strict=True):
        rebuilt.append(parts[h][taken[h] : taken[h] + size])
        taken[h] += size
    assert taken == {False: len(train), True: len(val)}
    assert np.array_equal(np.concatenate(rebuilt), corpus)
    # Held out whole: the first held-out chapter is Genesis 10, from its first verse on.
    assert val.tobytes().startswith(b"10:1 Now these are the generations of the sons of Noah")
    assert b"\n10:1 Now these are the generations" not in train.tobytes()
    assert train.tobytes().startswith(b"Genesis\n\n1:1 In the beginning")


@pytest.mark.parametrize(
    ("fraction", "error"),
    [
        (0.0, "val_fraction must be in (0, 1), got 0.0."),
        (1.0, "val_fraction must be in (0, 1), got 1.0."),
        (
            0.0005,
            "val_fraction 0.0005 holds out none of the 1,189 chapters; use at least "
            "1/1189 = 0.00084",
        ),
    ],
)
def test_split_refuses_a_fraction_that_leaves_a_part_empty(fraction, error):
    with pytest.raises(ValueError) as info:
        data.split(data.load_corpus(), fraction)
    assert str(info.value) == error


def test_missing_corpus_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"git checkout examples/data.*make_kjv\.py"):
        data.load_corpus(tmp_path / "kjv.txt.xz")


def test_a_corpus_file_is_read_as_bytes(tmp_path):
    path = tmp_path / "tiny.txt.xz"
    path.write_bytes(lzma.compress(b"Genesis\n\n1:1 Light.\n1:2 Dark.\n2:1 Day.\n"))
    corpus = data.load_corpus(path)
    assert corpus.dtype == np.uint8 and not corpus.flags.writeable
    assert data.chapter_starts(corpus).tolist() == [0, 30]


def test_validation_windows_tile_the_text_once():
    text = np.arange(100, dtype=np.uint8)
    windows = data.eval_windows(text, seq_len=16, multiple_of=8)
    tokens, weight = windows["tokens"], windows["weight"]
    # (100 - 1) // 16 = 6 windows, padded to 8; each window's last byte starts the next.
    assert tokens.shape == (8, 17) and tokens.dtype == np.int32
    assert weight.tolist() == [1.0] * 6 + [0.0] * 2
    assert np.array_equal(tokens[:6, :-1].ravel(), text[:96])
    assert np.array_equal(tokens[:6, 1:].ravel(), text[1:97])
    assert np.array_equal(tokens[6:], tokens[[0, 0]])
    with pytest.raises(ValueError, match="too few for one window"):
        data.eval_windows(text[:16], seq_len=16)


def test_validation_windows_can_be_a_fixed_spread_subset():
    text = np.arange(1000) % 251
    windows = data.eval_windows(text, seq_len=16, multiple_of=8, count=5)
    tokens, weight = windows["tokens"], windows["weight"]
    assert tokens.shape == (8, 17) and weight.tolist() == [1.0] * 5 + [0.0] * 3
    # Evenly spread: the first at the text's start, the last ending at its last byte.
    assert tokens[:5, 0].tolist() == [0, 246, 492 % 251, 737 % 251, 983 % 251]
    assert np.array_equal(tokens[4], text[-17:])
    # As many windows as tiling gives, or more: the tiling, every byte scored once.
    tiled = data.eval_windows(text, seq_len=16, multiple_of=8)
    many = data.eval_windows(text, seq_len=16, multiple_of=8, count=10_000)
    assert np.array_equal(many["tokens"], tiled["tokens"])
    with pytest.raises(ValueError, match="count must be a positive number of windows, got 0"):
        data.eval_windows(text, seq_len=16, count=0)


def brute_force_span(sample: bytes, text: bytes) -> int:
    return max(
        (
            j - i
            for i, j in itertools.combinations(range(len(sample) + 1), 2)
            if sample[i:j] in text
        ),
        default=0,
    )


@pytest.mark.parametrize(
    ("sample", "text", "span"),
    [
        (b"the cat sat", b"a cat on the mat", overlap.Span(5, 3, 1)),  # " cat "
        (b"xyz", b"abc", overlap.Span(0, 0, -1)),
        (b"", b"abc", overlap.Span(0, 0, -1)),
        (b"abc", b"", overlap.Span(0, 0, -1)),
        (b"abc", b"zzabczz", overlap.Span(3, 0, 2)),  # the whole sample
        (b"aaaa", b"aa", overlap.Span(2, 0, 0)),
        (b"ab_abc", b"abc ab", overlap.Span(3, 3, 0)),  # the later, longer one wins
    ],
)
def test_longest_shared_span(sample, text, span):
    assert overlap.longest_shared_span(sample, text) == span


def test_longest_shared_span_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sample = rng.integers(97, 100, rng.integers(0, 12)).astype(np.uint8).tobytes()
        text = rng.integers(97, 100, rng.integers(0, 30)).astype(np.uint8).tobytes()
        span = overlap.longest_shared_span(sample, text)
        assert span.length == brute_force_span(sample, text), (sample, text)
        piece = sample[span.sample_start : span.sample_start + span.length]
        if span.length:
            assert text[span.text_start : span.text_start + span.length] == piece
