#!/usr/bin/env bash
# Builds the documentation site into docs/_build/html, offline and with warnings as errors:
# the guides, the API reference from the docstrings (Sphinx + MyST + autodoc, nitpicky) and
# the benchmark tables and figures from benchmarks/*.json (scripts/figures.py, which
# docs/conf.py runs), then checks every internal link and anchor (scripts/check_links.py).
# Creates or reuses .venv (or the venv JZERO_DOCS_VENV names: .ci/run passes the tests'
# .venv-test, whose jax, flax and optax are installed already) and installs jzero[docs]
# into it, as scripts/test.sh does with jzero[dev]; only that install needs the network.
# Extra arguments go to sphinx-build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${JZERO_DOCS_VENV:-.venv}"
bash scripts/venv.sh "$venv"  # a Python >= 3.12 (scripts/python.sh finds one)
"$venv/bin/python" -m pip install -q -e '.[docs]'
export JAX_PLATFORMS=cpu  # autodoc imports jzero; nothing touches an accelerator
rm -rf docs/_build/html
"$venv/bin/python" -m sphinx -b html -n -W --keep-going -E -q "$@" docs docs/_build/html
"$venv/bin/python" scripts/check_links.py docs/_build/html
echo "docs/_build/html/index.html"
