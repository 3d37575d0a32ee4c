"""Where things are, for tests in any folder: the repository, the tests, their workers
(scripts run in subprocesses) and the examples."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKERS = TESTS / "workers"
EXAMPLES = REPO / "examples"
VENDOR = TESTS / "vendor"
