#!/usr/bin/env bash
# Usage: bash scripts/venv.sh DIR [VERSION]   (VERSION as scripts/python.sh takes it)
# Makes DIR a venv of a Python >= 3.12 (scripts/python.sh finds one), recreating a venv left
# there by an older Python; then upgrades pip. Prints nothing on success.
set -euo pipefail
dir="$1"
want="${2:-3.12}"
here="$(dirname "$0")"
if [[ -x "$dir/bin/python" ]] \
    && [[ "$(JZERO_PYTHON="$dir/bin/python" bash "$here/python.sh" "$want" 2>/dev/null)" \
        == "$dir/bin/python" ]]; then
    exit 0  # already a venv of an accepted Python
fi
py="$(bash "$here/python.sh" "$want")"
"$py" -m venv --clear "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
