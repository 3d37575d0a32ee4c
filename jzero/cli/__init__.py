"""The command line: ``python -m jzero estimate ...`` (or the ``jzero`` script)."""

from .main import main as main
