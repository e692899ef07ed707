#!/usr/bin/env bash
# Set everything up and run the checks: ruff (lint + format), mypy, then the pytest suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k roundtrip).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== setup: .venv with imgpack[test,ray,dali,hf,plot]: the first time about 2.5 GiB, most of" \
    "it NVIDIA DALI's CUDA wheels (tests/test_dali.py reads the outputs with DALI), 3 minutes on a" \
    "quiet machine with a fast mirror, up to 20 on a loaded one; later runs reuse it in seconds" >&2
EXTRAS=test,ray,dali,hf,plot source scripts/setup_env.sh

# The docs show h5ls and mdb_stat output, which tests/test_docs.py checks against the real tools:
# Debian's hdf5-tools and lmdb-utils, installed where this runs as root (CI); else those few
# lines are skipped, saying so.
if ! command -v h5ls >/dev/null || ! command -v mdb_stat >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== setup: apt-get install hdf5-tools lmdb-utils (for the docs' h5ls and mdb_stat)" >&2
        apt-get install -y -qq --no-install-recommends hdf5-tools lmdb-utils >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 &&
              apt-get install -y -qq --no-install-recommends hdf5-tools lmdb-utils >/dev/null 2>&1; } ||
            echo "   (not installed: the docs' h5ls and mdb_stat examples will be skipped)" >&2
    fi
fi

echo "== ruff check" >&2
ruff check imgpack tests scripts
echo "== ruff format --check" >&2
ruff format --check imgpack tests scripts
echo "== mypy imgpack" >&2
mypy imgpack
# Two pytest processes (pytest-xdist), each test module in one of them: the docs pages (one
# module, about 6 minutes) run beside the rest. -n 0 runs everything in one process.
echo "== pytest: 10 minutes on 2 CPUs at load 2, up to 30 at load 6-9, in 2 processes (the" \
    "docs pages, Ray and the killed-process tests take most of it); -x stops at the first" \
    "failure, -k NAME runs some" >&2
# As root (CI), the suite runs in a network namespace of its own with only loopback: the S3
# server, the Ray clusters and everything else the tests start can reach no other address.
pytest=(python -m pytest -q -n 2 --dist loadfile "$@")
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null &&
    unshare -n true 2>/dev/null; then
    echo "   (in a network namespace with only loopback)" >&2
    exec unshare -n bash -c 'ip link set lo up && exec "$@"' bash "${pytest[@]}"
fi
exec "${pytest[@]}"
