"""The command line: ``python -m jzero estimate ...`` (or the ``jzero`` script).

Modules: ``main`` (the arguments and the printed tables), ``units`` (parameter counts and
memory sizes, read and printed) and ``plot`` (the ZeRO paper's Figure 1 for one model).
"""

from .main import main as main
