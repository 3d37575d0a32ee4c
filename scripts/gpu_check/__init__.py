"""The GPU check: every jzero claim that needs a GPU, measured, its targets marked PASS /
FAIL in one JSON (``bash scripts/gpu_check.sh --help``).

From the top down: :mod:`.driver` (the command: which parts run, each in a fresh process,
merged into the JSON) -> :mod:`.part` (one part in its process) -> :mod:`.catalog` (the
pieces, the presets) -> the pieces :mod:`.timed` (``n1``, ``prefetch``, ``quant``),
:mod:`.offload` (``offload``, ``offload_fixed``, ``offload_32k``, ``host_rate``) and
:mod:`.agreement` -> :mod:`.common` (targets, the machine, batches). ``examples/`` (the
GPT the pieces train) goes on ``sys.path`` here, as ``scripts/bench.py`` puts it there.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
