"""The smoke selection (``-m smoke``, tests/README.md): at least one test in every folder of
tests/ that holds tests, each checking its area's main promise end to end. Its time is
measured (`python scripts/test_durations.py --smoke`: tests/durations_smoke.md), never
asserted here."""

from __future__ import annotations

import ast

from _paths import REPO as ROOT
from _paths import TESTS


def _marks_smoke(node: ast.AST) -> bool:
    """``pytest.mark.smoke`` in the code (a decorator, or a ``pytest.param``'s ``marks``),
    not in a comment or a string."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == "smoke" and ast.unparse(n) == "pytest.mark.smoke"
        for n in ast.walk(node)
    )


def _test_files(folder) -> list:
    return [*folder.glob("test_*.py"), *folder.glob("*_test.py")]


def _has_smoke(folder) -> bool:
    """A test of the folder marked smoke, or, for a vendored suite (kept unchanged), its
    conftest.py marking one."""
    conftest = folder / "conftest.py"
    if folder.parent.name == "vendor" and conftest.exists():
        return _marks_smoke(ast.parse(conftest.read_text()))
    return any(_marks_smoke(ast.parse(p.read_text())) for p in _test_files(folder))


def test_every_folder_with_tests_has_a_smoke_test():
    folders = sorted({p.parent for p in [*TESTS.rglob("test_*.py"), *TESTS.rglob("*_test.py")]})
    assert len(folders) >= 17
    missing = [str(f.relative_to(TESTS)) for f in folders if not _has_smoke(f)]
    assert not missing, f"folders without a test marked pytest.mark.smoke: {missing}"


def test_the_smoke_marker_is_declared_and_documented():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"smoke:' in pyproject
    assert "-m smoke" in (TESTS / "README.md").read_text()
    assert "-m smoke" in (ROOT / "README.md").read_text()
