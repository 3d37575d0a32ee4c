"""What can go wrong with a checkpoint, as exception types a caller can tell apart.

Every one is a :class:`CheckpointError` (a ``ValueError``), so ``except CheckpointError``
catches them all; the subclasses say *whose* problem it is:

- :class:`CheckpointMismatchError`: the checkpoint is intact, but it holds another model or
  optimizer than the one restored into -- the caller's to fix, never skipped as corrupt.
- :class:`CheckpointNotFoundError`: the directory does not exist (also a
  ``FileNotFoundError``); nothing was created.
- :class:`CheckpointSaveError`: a save failed (often in the background, reported at the
  next call); the checkpoints written before it are intact.
- A plain :class:`CheckpointError`: the checkpoint is missing, unreadable or corrupt.
"""

from __future__ import annotations

import re


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: missing, corrupt, or of another model."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint that does not match the model / optimizer it is restored into."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist."""


class CheckpointSaveError(CheckpointError):
    """A save that did not reach the disk: its step was not written."""


_OS_ERROR = re.compile(r"os_error_code=|\[Errno \d+\]")
# tensorstore's annotations, e.g. [tensorstore_spec='{...json...}'] [source locations='...'];
# the JSON holds no single quote, so each ends at the first "']".
_ANNOTATION = re.compile(r"\s*\[(?!os_error_code=)[a-z_ ]+='.*?'\]")


def storage_error_line(e: BaseException) -> str:
    """The useful part of an Orbax / tensorstore error: the line that names the OS error
    (e.g. "File too large"; else the first line), without tensorstore's annotations (its
    spec, which can run to kilobytes, and source locations), cut after the OS error code
    and shortened in the middle."""
    lines = str(e).strip().split(" See full TensorStore details")[0].splitlines() or [""]
    line = next((x for x in lines if _OS_ERROR.search(x)), lines[0])
    line = _ANNOTATION.sub("", line)
    code = re.search(r"\[os_error_code=[^\]]*\]", line)
    line = (line[: code.end()] if code else line).rstrip(".")
    return line if len(line) <= 400 else f"{line[:200]} ... {line[-200:]}"
