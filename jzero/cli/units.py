"""Numbers with units, as the command line reads and prints them.

Parameter counts: ``7.5e9``, ``7.5B``, ``350M``, ``125K``, ``1.2T`` (K/M/B/T are 10^3 to
10^12, any case). Memory sizes: ``80GB`` (decimal, 10^3 to 10^12 per step), ``80GiB``
(binary, 2^10 to 2^40 per step) or bytes (``80e9``). :func:`format_params` prints a
count that :func:`parse_params` reads back.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal

# A non-negative decimal, optionally in scientific notation: 7, 7.5, .5, 7.5e9, 1e+04.
_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?"
_PARAMS = re.compile(rf"\s*({_NUMBER})\s*([kmbt]?)\s*", re.IGNORECASE)
_BYTES = re.compile(rf"\s*({_NUMBER})\s*(?:([kmgt])(i?)b?|(b))?\s*", re.IGNORECASE)
_PARAM_SCALES = (("T", 12), ("B", 9), ("M", 6), ("K", 3))  # suffix, power of 10
_STEPS = "kmgt"  # memory prefixes: power 1 to 4 of 1000, or of 1024 with "i"
MIN_BARE_BYTES = 2**20
"""A memory size without a unit below this (1 MiB) is refused as a forgotten unit."""


def _matched(pattern: re.Pattern, text: str, what: str, forms: str) -> re.Match:
    """``pattern``'s full match of ``text``; a ``ValueError`` naming the forms otherwise."""
    m = pattern.fullmatch(text)
    if m is None:
        raise ValueError(f"cannot parse {what} {text!r}: write {forms}.")
    return m


def parse_params(text: str) -> float:
    """A parameter count: a number (``7.5e9``) or one with a K/M/B/T suffix (``7.5B``).

    The decimal is scaled exactly (``1.2T`` is 1.2·10^12, no float noise), so every
    count :func:`format_params` prints reads back as the value it shows.

    Raises:
        ValueError: ``text`` is not a count in one of those forms.

    Examples:
        >>> parse_params("7.5B"), parse_params("350m"), parse_params("1.2e9")
        (7500000000.0, 350000000.0, 1200000000.0)
    """
    forms = "a number (7.5e9) or one with a K, M, B or T suffix (125K, 350M, 7.5B, 1.2T)"
    m = _matched(_PARAMS, text, "parameter count", forms)
    power = dict(_PARAM_SCALES).get(m[2].upper(), 0)
    return float(Decimal(m[1]).scaleb(power))


def parse_bytes(text: str) -> float:
    """A memory size: ``80GB`` (10^9 bytes each), ``80GiB`` (2^30 each) or bytes (``80e9``).

    Decimal units are KB, MB, GB and TB; binary units KiB, MiB, GiB and TiB; the B may be
    left out (``80G``, ``80Gi``) and case does not matter. A number with no unit is bytes,
    and refused below :data:`MIN_BARE_BYTES` (``80`` is surely ``80GB``, not 80 bytes);
    write ``80B`` to mean 80 bytes.

    Raises:
        ValueError: ``text`` is not a size in one of those forms, or is a unit-less
            number below 1 MiB.

    Examples:
        >>> parse_bytes("80GB"), parse_bytes("1 KiB"), parse_bytes("80e9")
        (80000000000.0, 1024.0, 80000000000.0)
    """
    forms = "a number with a unit (80GB, 80GiB, 512MB, 64KiB) or bytes (80e9)"
    m = _matched(_BYTES, text, "memory size", forms)
    number, prefix, binary, byte_unit = m.groups()
    value = Decimal(number)
    if prefix:
        step = _STEPS.index(prefix.lower()) + 1
        value *= 1024**step if binary else Decimal(1000) ** step
    elif not byte_unit and value < MIN_BARE_BYTES:
        raise ValueError(
            f"memory size {text.strip()!r} has no unit, so it reads as {number} bytes: write "
            f"{number}GB ({number}·10^9 bytes) or {number}GiB ({number}·2^30 bytes), "
            f"or {number}B if you mean bytes."
        )
    return float(value)


def format_params(count: float) -> str:
    """A parameter count for people, to 4 significant digits: 7.5e9 -> ``"7.5B"``.

    The suffix is chosen after rounding (999,960,000 -> ``"1B"``, not ``"1000M"``), and
    :func:`parse_params` reads the result back as exactly ``float(f"{count:.4g}")``.

    Examples:
        >>> format_params(7.5e9), format_params(1e12), format_params(123_456), format_params(42)
        ('7.5B', '1T', '123.5K', '42')
    """
    exact = Decimal(count)  # rounded in decimal: no float noise from dividing by 10^power
    for suffix, power in _PARAM_SCALES:
        shown = _significant(exact.scaleb(-power), digits=4)
        if shown >= 1:
            return f"{shown.normalize():f}{suffix}"
    return f"{_significant(exact, digits=4).normalize():f}"


def _significant(value: Decimal, *, digits: int) -> Decimal:
    """``value`` rounded half-even to ``digits`` significant digits (as ``:.4g`` rounds)."""
    if not value:
        return value
    step = Decimal(1).scaleb(value.adjusted() - digits + 1)
    return value.quantize(step, rounding=ROUND_HALF_EVEN)


def format_bytes(count: float) -> str:
    """A byte count for people, in decimal units to 4 significant digits (``parse_bytes``
    reads it back): 2_300_000 -> ``"2.3MB"``, 512 -> ``"512B"``."""
    for suffix, power in (("TB", 12), ("GB", 9), ("MB", 6), ("KB", 3)):
        shown = _significant(Decimal(count).scaleb(-power), digits=4)
        if shown >= 1:
            return f"{shown.normalize():f}{suffix}"
    return f"{int(count)}B"
