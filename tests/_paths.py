"""Where things are, for tests in any folder: the repository, the tests, their workers
(scripts run in subprocesses) and the examples."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKERS = TESTS / "workers"
EXAMPLES = REPO / "examples"
VENDOR = TESTS / "vendor"


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (``examples/`` on ``sys.path``, as the
    scripts put it themselves)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
