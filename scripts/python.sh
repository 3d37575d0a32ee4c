#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (what jax >= 0.11, and so jzero, needs), newest first:
# $JZERO_PYTHON if set, then python3.13 / python3.12 / python3 on PATH, then pyenv's
# installed versions. Exits 1 with what to install when there is none.
# Sourced by scripts/test.sh, main.sh, docs.sh and test_oldest.sh (which asks for 3.12).
want="${1:-3.12}"  # the oldest minor accepted ("3.12"), or an exact minor with "=3.12"
ok() {
    "$1" -c "import sys; v = sys.version_info[:2]; w = tuple(map(int, '${want#=}'.split('.')));
sys.exit(not (v == w if '${want}'.startswith('=') else v >= w))" 2>/dev/null
}
candidates=()
[[ -n "${JZERO_PYTHON:-}" ]] && candidates+=("$JZERO_PYTHON")
for v in 3.13 3.12; do candidates+=("$(command -v "python$v" 2>/dev/null || true)"); done
if command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root)"
    for d in $(ls -d "$root"/versions/3.1[3-9]* "$root"/versions/3.12* 2>/dev/null | sort -rV); do
        candidates+=("$d/bin/python")
    done
fi
candidates+=("$(command -v python3 2>/dev/null || true)")
for py in "${candidates[@]}"; do
    if [[ -n "$py" && -x "$py" ]] && ok "$py"; then
        echo "$py"
        exit 0
    fi
done
echo "jzero needs Python ${want#=} or newer (jax >= 0.11 requires 3.12+); found none:" \
    "install it (e.g. 'pyenv install 3.12', 'apt-get install python3.12', or from python.org)" \
    "and run again, or point JZERO_PYTHON at it." >&2
exit 1
