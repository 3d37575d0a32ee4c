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
