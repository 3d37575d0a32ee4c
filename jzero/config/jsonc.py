"""A DeepSpeed config file's text as a value: JSON with comments, each key once per object.

DeepSpeed reads config files with ``hjson`` and refuses a key given twice in one object.
jzero reads JSON plus hjson's comments -- ``#`` and ``//`` to the end of the line, and
``/* ... */`` -- without depending on hjson: a comment holds no value, so dropping it cannot
change one. hjson's other liberties (quoteless strings, missing or trailing commas) are left
to the JSON reader, which refuses them with their line and column. A key given twice is
returned with its dotted path and every value it was given, for the caller to refuse: a
plain JSON reader would keep the last one silently.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string (kept whole, so a "#" or "//" inside one is text) or a comment.
_STRING_OR_COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|#[^\n]*|//[^\n]*|/\*.*?\*/', re.DOTALL)


def without_comments(text: str) -> str:
    """``text`` with each comment outside strings blanked out; newlines stay, so the JSON
    reader's line and column numbers are the file's."""

    def blank(match: re.Match) -> str:
        token = match[0]
        return token if token.startswith('"') else re.sub(r"[^\n]", " ", token)

    return _STRING_OR_COMMENT.sub(blank, text)


class _Object(dict):
    """A JSON object as read: its keys (the last value of each, as ``json`` keeps) and
    ``repeated``, ``{key: [every value given, in order]}`` for the keys given twice or more."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        given = [key for key, _ in pairs]
        self.repeated = {
            key: [value for k, value in pairs if k == key] for key in self if given.count(key) > 1
        }


def parse(text: str) -> tuple[Any, dict[str, list]]:
    """The value of the JSON-with-comments ``text`` (plain dicts and lists), and its repeated
    keys: ``{dotted path: [every value given, in order]}``. Raises ``json.JSONDecodeError``."""
    repeated: dict[str, list] = {}

    def plain(value: Any, path: str) -> Any:
        if isinstance(value, list):
            return [plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if not isinstance(value, _Object):
            return value
        for key, values in value.repeated.items():
            repeated[_join(path, key)] = values
        return {key: plain(item, _join(path, key)) for key, item in value.items()}

    return plain(json.loads(without_comments(text), object_pairs_hook=_Object), ""), repeated


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
