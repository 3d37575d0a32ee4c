"""CI's tier of the suite: every test, and of each test's parameter grid a covering subset.

The whole suite took 95 minutes of a 2-core machine (and CI's 2 cores ran out of their 90
at 61 %), so ``scripts/test.sh`` (the README's test command, which CI runs) leaves out the
cases marked ``extended``: ``-m ''`` runs them too. A test whose cases vary two or more
parameters (e.g. ZeRO stage x optimizer) keeps, in collection order, the fewest cases a
greedy cover finds in which every value of every parameter appears at least once
("each choice": stage 3 and ``multisteps`` each run, not necessarily together); the
rest are marked ``extended``. A test with one parameter keeps every case, and so does one
marked ``every_case`` (a grid whose every cell is a claim, e.g. the single-device Optax
oracle at every stage for every optimizer, or the GPU compiles the issue names per stage).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

EXTENDED = "extended"  # the markers are declared in pyproject.toml


def _choices(item: pytest.Item) -> frozenset:
    """The (parameter, value) pairs of one case, each value by its ``repr``."""
    spec = getattr(item, "callspec", None)
    return frozenset((k, repr(v)) for k, v in spec.params.items()) if spec else frozenset()


def covering(cases: list[pytest.Item]) -> list[pytest.Item]:
    """A subset of ``cases`` in which each value of each parameter appears: greedily the
    case that covers the most values not yet covered, the earliest on a tie."""
    choices = [_choices(case) for case in cases]
    wanted, kept = set().union(*choices), []
    while wanted:
        best = max(range(len(cases)), key=lambda i: (len(choices[i] & wanted), -i))
        kept.append(cases[best])
        wanted -= choices[best]
    return kept


def mark_extended(items: list[pytest.Item]) -> None:
    """Marks ``extended`` the cases of each multi-parameter grid outside its cover."""
    tests = defaultdict(list)
    for item in items:
        tests[item.parent.nodeid, getattr(item, "originalname", item.name)].append(item)
    for cases in tests.values():
        params = {name for case in cases for name, _ in _choices(case)}
        if len(params) < 2 or cases[0].get_closest_marker("every_case"):
            continue
        kept = {id(case) for case in covering(cases)}
        for case in cases:
            if id(case) not in kept:
                case.add_marker(EXTENDED)
