"""What reading a DeepSpeed config found, told all at once: every problem in one
:class:`DeepSpeedConfigError`, every key that changes nothing in one
:class:`DeepSpeedConfigWarning`.

The config is read to the end before either is raised or warned, so one run names every key
to fix (the Hugging Face Trainer's ZeRO-2 config alone has 13 ``"auto"`` values).
"""

from __future__ import annotations

import dataclasses
import warnings


class DeepSpeedConfigWarning(UserWarning):
    """DeepSpeed keys that jzero accepts but that change nothing, each with why."""


class DeepSpeedConfigError(ValueError):
    """Every key of a DeepSpeed config that jzero cannot use, each with why and the fix.

    Attributes:
        keys: the dotted path of each problem's key (``zero_optimization.stage``; ``""`` for
            the config as a whole), in the message's order.
        auto: the keys whose value is the Hugging Face Trainer's ``"auto"``, in the same order.
    """

    def __init__(self, problems: list[tuple[str, str]], auto: list[str]):
        problems = sorted(problems, key=lambda problem: problem[0])
        self.keys = tuple(key for key, _ in problems)
        self.auto = tuple(sorted(auto))
        lines = [line for _, line in problems]
        text = lines[0] if len(lines) == 1 else "\n  ".join([f"{len(lines)} problems:", *lines])
        if self.auto:
            filled = ", ".join(f'"{key}": ...' for key in self.auto)
            text += (
                f'\nReplace each "auto" with its value in the config, or pass the values: '
                f"jzero.from_deepspeed_config(config, auto={{{filled}}})."
            )
        super().__init__(f"DeepSpeed config: {text}")


@dataclasses.dataclass
class Findings:
    """Collected while the config is read; :meth:`raise_problems` and :meth:`warn_notes`
    tell them at the end."""

    problems: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (key, line)
    notes: list[str] = dataclasses.field(default_factory=list)  # "key: why it has no effect"
    auto: list[str] = dataclasses.field(default_factory=list)  # keys whose value is "auto"

    def problem(self, key: str, line: str) -> None:
        """``line`` says what is wrong with ``key`` (its dotted path) and how to fix it."""
        self.problems.append((key, line))

    def raise_problems(self) -> None:
        if self.problems:
            raise DeepSpeedConfigError(self.problems, self.auto)

    def warn_notes(self, stacklevel: int) -> None:
        if self.notes:
            lines = "\n  ".join(self.notes)
            warnings.warn(
                DeepSpeedConfigWarning(f"DeepSpeed keys with no effect in jzero:\n  {lines}"),
                stacklevel=stacklevel + 1,
            )
