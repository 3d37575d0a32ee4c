"""The Hugging Face Trainer's ``"auto"`` values, filled in by the caller.

The Trainer's DeepSpeed configs write ``"auto"`` for values that it fills in from its own
arguments (the batch sizes, the optimizer's lr, fp16 or bf16...). jzero has no Trainer:
``from_deepspeed_config(config, auto={"train_micro_batch_size_per_gpu": 8, ...})`` fills
them, keyed by the dotted paths its error names. It fills ``"auto"`` values only: a path the
config lacks, or whose value is not ``"auto"``, is a problem, since jzero never replaces a
value that the config writes. The filled values are checked like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .findings import Findings
from .keys import AUTO

_ABSENT = object()


def fill_auto(config: Any, auto: Mapping[str, Any], findings: Findings) -> Any:
    """``config`` with each ``"auto"`` named in ``auto`` replaced by its value (the caller's
    mapping is not changed); a key of ``auto`` that names no ``"auto"`` is a problem."""
    if not isinstance(auto, Mapping) or not all(isinstance(path, str) for path in auto):
        raise TypeError(
            "auto= maps dotted key paths to values, e.g. "
            f'{{"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 3e-4}}; got {auto!r}.'
        )
    for path, value in auto.items():
        given = _at(config, path.split("."))
        if isinstance(given, str) and given == AUTO:
            config = _replaced(config, path.split("."), value)
        elif given is _ABSENT:
            findings.problem(
                path,
                f"auto={{{path!r}: {value!r}}} names no key of the config: pass only the keys "
                'whose value is "auto", by their dotted path.',
            )
        else:
            findings.problem(
                path,
                f"auto={{{path!r}: {value!r}}}, but the config writes {path} = {given!r}, not "
                '"auto": jzero never replaces a written value. Drop the key from auto=, or edit '
                "the config.",
            )
    return config


def _at(node: Any, keys: list[str]) -> Any:
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def _replaced(node: Mapping, keys: list[str], value: Any) -> dict:
    key, *rest = keys
    return {**node, key: _replaced(node[key], rest, value) if rest else value}
