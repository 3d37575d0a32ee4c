#!/usr/bin/env bash
# The main job: train the example GPT with ZeRO on the devices present (8 CPU devices
# when there is no GPU). Extra arguments go to examples/train_lm.py (e.g. --stage 2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[examples]'
exec .venv/bin/python examples/train_lm.py "$@"
