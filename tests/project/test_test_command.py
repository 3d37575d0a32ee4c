"""The README's test command (scripts/test.sh: ``-n 2 --dist loadgroup``) relies on
pytest-xdist's ``xdist_group``: one worker runs a group, so a module-scoped fixture that
its tests share (the GPU check's five-minute dry run, train_lm's runs) is built once, and
the GPU compiles stay on one worker. pytest 9.2 silently breaks that grouping in
pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386: the tests are spread as if unmarked), so
pyproject.toml keeps pytest below 9.2 until a fixed xdist is released; this test holds the
installed pair to it."""

import subprocess
import sys

MINI_SUITE = """
import os
import time

import pytest


def _record(name):
    with open(name, "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    _record(f"grouped{i}")
    time.sleep(0.2)


@pytest.mark.parametrize("i", range(4))
def test_free(i):
    _record(f"free{i}")
    time.sleep(0.2)
"""


def test_one_worker_runs_an_xdist_group(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mini.py").write_text(MINI_SUITE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "test_mini.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    grouped = {(tmp_path / f"grouped{i}").read_text() for i in range(3)}
    every = grouped | {(tmp_path / f"free{i}").read_text() for i in range(4)}
    assert every == {"gw0", "gw1"}  # both workers ran tests
    assert len(grouped) == 1, f"the group ran on {sorted(grouped)}: xdist_group is ignored"


ORDERED_SUITE = """
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_it(i):
    with open("order", "a") as f:
        f.write("{name} ")
"""

ORDERING_CONFTEST = """
import sys

import pytest

sys.path.insert(0, {tests!r})
from _durations import longest_groups_first  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items[:] = longest_groups_first(items, {{"test_b.py": 100.0, "test_a.py": 1.0}})
"""


def test_the_longest_recorded_file_runs_first(tmp_path):
    """scripts/test.sh's order (tests/durations.json, --no-loadscope-reorder): test_b.py,
    recorded at 100 s, before test_a.py (1 s); xdist's own order (most tests first)
    starts test_a.py's three."""
    from _paths import TESTS

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(ORDERING_CONFTEST.format(tests=str(TESTS)))
    (tmp_path / "test_a.py").write_text(ORDERED_SUITE.format(n=3, name="a"))
    (tmp_path / "test_b.py").write_text(ORDERED_SUITE.format(n=1, name="b"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
               "--dist", "loadgroup"]  # fmt: skip
    for reorder, first in (("--no-loadscope-reorder", "b"), ("--loadscope-reorder", "a")):
        (tmp_path / "order").unlink(missing_ok=True)
        done = subprocess.run(
            [*command, reorder], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert (tmp_path / "order").read_text().split()[0] == first, reorder
