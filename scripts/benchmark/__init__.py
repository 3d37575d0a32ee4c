"""The benchmark (``python scripts/bench.py``) by concern: :mod:`.runs` (what each run
trains and how it is measured), :mod:`.checkpoints` (checkpoint throughput),
:mod:`.targets` (the design targets checked on the result) and :mod:`.tables` (the result
as text). ``examples/`` (the GPT, its data) and ``scripts/`` (``max_model.py``) go on
``sys.path`` here.
"""

import sys
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_SCRIPTS.parent / "examples"))
sys.path.insert(0, str(_SCRIPTS))
