"""Reading a DeepSpeed config one JSON object at a time, against a table of its keys.

Every key of an object must be in its table (:class:`Key`); a key that jzero cannot honour
is ``refused``, or noted for one warning (``no_effect``), unless its value describes what
jzero does anyway (``matches``). Nothing is silently ignored, and nothing stops the reading:
an unknown key, a value of the wrong type, the Hugging Face Trainer's ``"auto"``, a missing
required key and a refusal are each listed in the :class:`~jzero.config.findings.Findings`,
to be raised together once the whole config is read. Reading a value whose problem is listed
raises :class:`Unreadable`, which stops only the reader that needed it (:func:`attempt`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from .findings import Findings

REQUIRED = object()  # Key.default of a key that must be present
AUTO = "auto"  # the Hugging Face Trainer's placeholder for a value it fills in


def integer(value: Any) -> int:
    """An int; a float with an integral value (JSON's ``5e8``) becomes one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("an integer")
    return value


def positive(value: Any) -> int:
    """An integer >= 1."""
    value = integer(value)
    if value < 1:
        raise TypeError("a positive integer")
    return value


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("a number")
    return float(value)


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("true or false")
    return value


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def obj(value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError("a JSON object")
    return value


def pair(value: Any) -> tuple[float, float]:
    """Two numbers, e.g. Adam's ``"betas": [0.9, 0.999]``."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError("a list of two numbers")
    return number(value[0]), number(value[1])


def anything(value: Any) -> Any:
    return value


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise TypeError(" or ".join(f'"{c}"' for c in choices))
        return value

    return check


@dataclasses.dataclass(frozen=True)
class Key:
    """How jzero handles one DeepSpeed key.

    Attributes:
        check: validates and converts the value; raises ``TypeError("what it must be")``.
        default: the value DeepSpeed uses when the key is absent, or ``REQUIRED``.
        no_effect: why the key changes nothing in jzero (warned), unless its value is in
            ``matches``.
        refused: why jzero cannot run with the key, and the fix (listed in the error),
            unless its value is in ``matches``.
        matches: values that mean what jzero does anyway.
    """

    check: Callable[[Any], Any] = anything
    default: Any = None
    no_effect: str | None = None
    refused: str | None = None
    matches: tuple = ()


def no_effect(why: str) -> Key:
    """A key jzero accepts with a warning: ``why`` it changes nothing."""
    return Key(no_effect=why)


class Unreadable(Exception):
    """A value was read whose problem is already listed in the findings."""


def attempt[T](read: Callable[..., T], *args: Any) -> T | None:
    """``read(*args)``, or None when it stopped at a value whose problem is already listed:
    the other readers go on, so one error names every problem."""
    try:
        return read(*args)
    except Unreadable:
        return None


class Section:
    """One JSON object of the config, checked against ``table`` when built.

    ``section[key]`` is the checked value, or the key's default; ``key in section`` says
    whether the config has it. Problems and notes go to ``findings``; reading a key whose
    problem is listed (or the whole object's, when it is not an object) raises
    :class:`Unreadable`.
    """

    def __init__(self, raw: Any, *, path: str, table: Mapping[str, Key], findings: Findings):
        self.path, self.table, self.findings = path, table, findings
        self.values: dict[str, Any] = {}
        self.invalid: set[str] = set()  # keys present with a value that failed its check
        self.readable = isinstance(raw, Mapping)
        if not self.readable:
            where = f"{path!r}" if path else "The config"
            findings.problem(path, f"{where} must be a JSON object, got {raw!r}.")
            return
        for key, value in raw.items():
            if key in table:
                self._read(key, value)
            else:
                self._unknown(key)
        for key, rule in table.items():
            if rule.default is REQUIRED and key not in raw:
                findings.problem(self.name(key), f"{self.name(key)} is required; add it.")

    def _unknown(self, key: str) -> None:
        where = f"{self.path!r}" if self.path else "the top level"
        close = difflib.get_close_matches(key, self.table, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        self.findings.problem(
            self.name(key),
            f"unknown key {self.name(key)!r}. jzero accepts at {where}: "
            f"{', '.join(sorted(self.table))}. Remove the key, or check its spelling{hint}.",
        )

    def _read(self, key: str, value: Any) -> None:
        rule = self.table[key]
        try:
            checked = rule.check(value)
        except TypeError as e:
            self._bad(key, value, f"{self.name(key)} must be {e}, got {value!r}")
            return
        if checked == AUTO:  # a check that takes any string (or anything) took it
            self._bad(key, value, f"{self.name(key)} = {value!r}")
            return
        self.values[key] = value = checked
        if rule.matches and value in rule.matches:
            return
        if rule.refused:
            self.refuse(key, rule.refused)
        if rule.no_effect:
            self.note(key, rule.no_effect)

    def _bad(self, key: str, value: Any, what: str) -> None:
        """``key``'s ``value`` is unusable (``what``): listed, and ``key`` unreadable."""
        name = self.name(key)
        self.invalid.add(key)
        if value != AUTO:
            self.findings.problem(name, f"{what}.")
            return
        self.findings.auto.append(name)
        self.findings.problem(
            name,
            f"{what}, the Hugging Face Trainer's placeholder: write the value, or pass it "
            "in auto=.",
        )

    def name(self, key: str) -> str:
        """The dotted path of ``key``, e.g. ``zero_optimization.stage``."""
        return f"{self.path}.{key}" if self.path else key

    def __contains__(self, key: str) -> bool:
        return key in self.values or key in self.invalid

    def __getitem__(self, key: str) -> Any:
        if key in self.values:
            return self.values[key]
        default = self.table[key].default
        if not self.readable or key in self.invalid or default is REQUIRED:
            raise Unreadable(self.name(key))
        return default

    def get(self, key: str, default: Any) -> Any:
        """The checked value of ``key``, or ``default`` (not DeepSpeed's) when absent."""
        if not self.readable or key in self.invalid:
            raise Unreadable(self.name(key))
        return self.values.get(key, default)

    def section(self, key: str, table: Mapping[str, Key]) -> Section:
        """The object at ``key`` (empty when absent), checked against ``table``."""
        if not self.readable or key in self.invalid:
            raise Unreadable(self.name(key))
        return Section(
            self.values.get(key, {}), path=self.name(key), table=table, findings=self.findings
        )

    def note(self, key: str, why: str) -> None:
        """``key`` changes nothing in jzero, because ``why`` (warned once, with the others)."""
        self.findings.notes.append(f"{self.name(key)}: {why}")

    def refuse(self, key: str, why: str) -> None:
        """``key`` (valid, or absent) cannot be honoured: ``why``, and the fix."""
        if key in self.values:
            value = f"{self.values[key]!r}"
        else:
            value = f"{self.table[key].default!r} (absent: DeepSpeed's default)"
        self.findings.problem(self.name(key), f"{self.name(key)} = {value}: {why}")
