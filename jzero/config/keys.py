"""Reading a DeepSpeed config one JSON object at a time, against a table of its keys.

Every key of an object must be in its table (:class:`Key`): an unknown key raises, naming its
path and the keys jzero accepts there; a key that jzero cannot honour raises (``refused``)
or is noted for one warning (``no_effect``), unless its value describes what jzero does
anyway (``matches``). Nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

REQUIRED = object()  # Key.default of a key that must be present


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
        refused: why jzero cannot run with the key (raised), unless its value is in
            ``matches``.
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


class Section:
    """One JSON object of the config, checked against ``table`` when built.

    ``section[key]`` is the checked value, or the key's default; ``key in section`` says
    whether the config has it. Notes for the warning go to ``notes``.
    """

    def __init__(self, raw: Any, *, path: str, table: Mapping[str, Key], notes: list[str]):
        self.path, self.table, self.notes = path, table, notes
        where = f"{path!r}" if path else "the top level"
        if not isinstance(raw, Mapping):
            raise ValueError(f"DeepSpeed config: {where} must be a JSON object, got {raw!r}.")
        unknown = [k for k in raw if k not in table]
        if unknown:
            raise ValueError(
                f"DeepSpeed config: unknown key {self.name(unknown[0])!r}. jzero accepts at "
                f"{where}: {', '.join(sorted(table))}. Remove the key, or check its spelling."
            )
        self.values = {}
        for key, value in raw.items():
            rule = table[key]
            try:
                value = rule.check(value)
            except TypeError as e:
                hint = ' ("auto" is filled in by the Hugging Face Trainer)' * (value == "auto")
                raise ValueError(
                    f"DeepSpeed config: {self.name(key)} must be {e}, got {value!r}{hint}."
                ) from None
            self.values[key] = value
            if rule.matches and value in rule.matches:
                continue
            if rule.refused:
                self.refuse(key, rule.refused)
            if rule.no_effect:
                self.note(key, rule.no_effect)

    def name(self, key: str) -> str:
        """The dotted path of ``key``, e.g. ``zero_optimization.stage``."""
        return f"{self.path}.{key}" if self.path else key

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def __getitem__(self, key: str) -> Any:
        if key in self.values:
            return self.values[key]
        default = self.table[key].default
        if default is REQUIRED:
            raise ValueError(f"DeepSpeed config: {self.name(key)} is required; add it.")
        return default

    def get(self, key: str, default: Any) -> Any:
        """The checked value of ``key``, or ``default`` (not DeepSpeed's) when absent."""
        return self.values.get(key, default)

    def section(self, key: str, table: Mapping[str, Key]) -> Section:
        """The object at ``key`` (empty when absent), checked against ``table``."""
        return Section(self.values.get(key, {}), path=self.name(key), table=table, notes=self.notes)

    def note(self, key: str, why: str) -> None:
        self.notes.append(f"{self.name(key)}: {why}")

    def refuse(self, key: str, why: str) -> NoReturn:
        value = f"{self[key]!r}" if key in self else f"{self[key]!r} (absent: DeepSpeed's default)"
        raise ValueError(f"DeepSpeed config: {self.name(key)} = {value}: {why}")
