#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install imgpack into it.
# Sourced by run.sh and test.sh. EXTRAS selects setup.cfg extras (e.g. "test").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${IMGPACK_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the requirements change: a stamp holds a hash of what was installed.
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
stamp="$VENV/.imgpack-installed"
want="$(cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/imgpack/_jpegregion.c" \
    "$ROOT/imgpack/_pixelsums.c" "$ROOT/imgpack/_batchcopy.c" "$ROOT/constraints.txt" "$ROOT/pyproject.toml" |
    sha256sum | cut -c1-16) $spec"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing imgpack$([ -n "$EXTRAS" ] && echo "[$EXTRAS]") (torch pinned by constraints.txt)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    # Not --quiet: a first install takes minutes, and each package it fetches says so.
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        -c "$ROOT/constraints.txt" -e "$ROOT$([ -n "$EXTRAS" ] && echo "[$EXTRAS]")" 2>&1 |
        { grep -v '^Requirement already satisfied' || true; } >&2   # pipefail: pip's status counts
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
