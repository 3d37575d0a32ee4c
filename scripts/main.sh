#!/usr/bin/env bash
# The main job: train the example GPT on the King James Bible with ZeRO stage 3 on the
# devices present (8 CPU devices when there is no GPU; about 5 minutes on 2 CPU cores), then
# print a short summary: the validation curve, tokens/s, a sample and the longest span it
# shares with the training text. Writes runs/train_lm/{train.log,loss.png,summary.json}.
# Extra arguments go to examples/train_lm.py (e.g. --stage 2, --verbose, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh .venv  # a Python >= 3.12 (scripts/python.sh finds one)
.venv/bin/python -m pip install -q -e '.[examples]'
exec .venv/bin/python examples/train_lm.py "$@"
