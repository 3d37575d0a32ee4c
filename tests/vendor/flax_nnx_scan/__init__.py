"""Flax's NNX scan-over-layers example (``06_scan_over_layers.py``), vendored unchanged; see
SOURCE.md.

The example is a script: after its classes it builds a model, calls it and prints. Its name
is not a Python identifier, so it is loaded here from its own source, and only its imports
and definitions are run (``Block``, ``ScanMLP``): importing this package touches no device
and prints nothing, and the file itself stays byte-identical to upstream.
"""

import ast
from pathlib import Path

EXAMPLE = Path(__file__).with_name("06_scan_over_layers.py")
DEFINITIONS = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef)


def _definitions(path: Path) -> dict:
    """The namespace of ``path`` after running its imports and definitions only."""
    module = ast.parse(path.read_text(), filename=str(path))
    module.body = [node for node in module.body if isinstance(node, DEFINITIONS)]
    namespace = {"__name__": f"{__name__}.scan_over_layers"}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace


_example = _definitions(EXAMPLE)
Block = _example["Block"]
ScanMLP = _example["ScanMLP"]
