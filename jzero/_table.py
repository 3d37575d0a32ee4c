"""Aligned plain-text tables: the one formatter every printed table in jzero uses."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def table(rows: Sequence[Sequence[str]], *, right: Collection[int] = ()) -> str:
    """``rows`` of strings as columns two spaces apart, trailing spaces trimmed.

    Args:
        rows: the header row first, then the body; every row has the same length.
        right: indices of the columns to right-align (numbers); the rest are left-aligned.

    Examples:
        >>> print(table([("name", "bytes"), ("w", "1,024")], right={1}))
        name  bytes
        w     1,024
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = (
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
