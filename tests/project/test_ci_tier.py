"""CI's tier (tests/_ci_tier.py): of a test's multi-parameter grid, CI keeps a subset in
which every value of every parameter appears; one-parameter grids and ``every_case`` ones
whole."""

import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import _ci_tier
from _ci_tier import covering

MINI_SUITE = """
import pytest


@pytest.mark.parametrize("name", ["a", "b", "c"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grid(stage, name):
    pass


@pytest.mark.every_case
@pytest.mark.parametrize("name", ["a", "b"])
@pytest.mark.parametrize("stage", [0, 1])
def test_whole_grid(stage, name):
    pass


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_parameter(stage):
    pass
"""


def _case(**params):
    return SimpleNamespace(callspec=SimpleNamespace(params=params))


def test_the_cover_holds_every_value_of_every_parameter_in_the_fewest_greedy_cases():
    cases = [_case(stage=s, name=n) for s, n in itertools.product(range(4), "abcdefg")]
    kept = covering(cases)
    assert len(kept) == 7  # the larger dimension
    assert {c.callspec.params["stage"] for c in kept} == set(range(4))
    assert {c.callspec.params["name"] for c in kept} == set("abcdefg")
    assert covering(cases) == kept  # the same on every worker


def test_ci_runs_the_cover_and_dash_m_empty_runs_every_case(tmp_path):
    (tmp_path / "_ci_tier.py").write_text(Path(_ci_tier.__file__).read_text())
    (tmp_path / "conftest.py").write_text(
        "import _ci_tier\nimport pytest\n\n\n@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    _ci_tier.mark_extended(items)\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    extended: x\n    every_case: x\n"
    )
    (tmp_path / "test_mini.py").write_text(MINI_SUITE)

    def collected(marks: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
             "-m", marks, "test_mini.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return [line for line in done.stdout.splitlines() if "::" in line]

    ci, every = collected("not extended"), collected("")
    assert len(every) == 12 + 4 + 4
    grid = [t for t in ci if "test_grid" in t]
    assert len(grid) == 4  # each stage once, each name at least once
    assert len([t for t in ci if "test_whole_grid" in t]) == 4
    assert len([t for t in ci if "test_one_parameter" in t]) == 4
