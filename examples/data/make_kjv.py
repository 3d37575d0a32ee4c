"""Rebuilds ``kjv.txt.xz`` from Debian's ``bible-kjv-text`` package (how it was made).

    cd "$(mktemp -d)" && apt-get download bible-kjv bible-kjv-text
    for deb in *.deb; do dpkg -x "$deb" pkg; done
    python examples/data/make_kjv.py pkg --out examples/data/kjv.txt.xz

``bible-kjv-text`` holds the King James text in the Bible Retrieval System's own
compressed format; ``bible-kjv``'s ``bible`` program reads it. This script has it print
every verse, Genesis 1:1 to Revelation 22:21, one per line as ``Ge1:1 In the beginning ...``
(``-f``: no pretty-printing, so no line breaks inside a verse), and writes the text as

    Genesis

    1:1 In the beginning God created the heaven and the earth.
    ...

one verse per line, a blank line and the book's name before each book, xz-compressed.
"""

from __future__ import annotations

import argparse
import lzma
import re
import subprocess
from pathlib import Path

# The 66 books in order, as the text names them; `bible -f` prints its own abbreviations.
BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon",
    "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude",
    "Revelation",
)  # fmt: skip
VERSE = re.compile(r"^(\w+?)(\d+:\d+) (.+)$")
VERSES = 31102


def verses(pkg: Path) -> list[str]:
    """``bible -f`` over the whole text: one ``Ge1:1 In the beginning ...`` line per verse."""
    cmd = [str(pkg / "usr/bin/bible"), "-p", str(pkg / "usr/lib"), "-f", "-m", "20000000"]
    out = subprocess.run([*cmd, "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    if len(lines) != VERSES:
        raise SystemExit(f"bible printed {len(lines)} lines, expected {VERSES} verses")
    return lines


def format_text(lines: list[str]) -> str:
    """The verses under book headings (see the module docstring)."""
    parts, abbrevs = [], []
    for line in lines:
        match = VERSE.match(line)
        if match is None:
            raise SystemExit(f"not a verse line: {line!r}")
        abbrev, ref, text = match.groups()
        if not abbrevs or abbrevs[-1] != abbrev:
            abbrevs.append(abbrev)
            parts.append(f"\n{BOOKS[len(abbrevs) - 1]}\n\n")
        parts.append(f"{ref} {text}\n")
    if len(abbrevs) != len(BOOKS):
        raise SystemExit(f"found {len(abbrevs)} books, expected {len(BOOKS)}")
    return "".join(parts).lstrip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pkg", type=Path, help="where bible-kjv and bible-kjv-text were dpkg -x'd")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "kjv.txt.xz")
    args = ap.parse_args()
    text = format_text(verses(args.pkg)).encode("ascii")
    args.out.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME))
    print(f"wrote {args.out}: {len(text):,} bytes of text, {args.out.stat().st_size:,} compressed")


if __name__ == "__main__":
    main()
