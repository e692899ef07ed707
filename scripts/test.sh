#!/usr/bin/env bash
# Set everything up and run the checks: ruff (lint + format), mypy, then the pytest suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k roundtrip).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,ray,dali,hf,plot source scripts/setup_env.sh

echo "== ruff check" >&2
ruff check imgpack tests scripts
echo "== ruff format --check" >&2
ruff format --check imgpack tests scripts
echo "== mypy imgpack" >&2
mypy imgpack
echo "== pytest" >&2
python -m pytest -q "$@"
