#!/usr/bin/env bash
# Set everything up, then run the whole test suite (CPU only; no network, no model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${VIRTUAL_ENV:-}" ]; then . .venv/bin/activate; fi
# Two worker processes (pytest-xdist): many tests wait on training subprocesses, killed and resumed
# runs or torchrun launches, and two workers keep both cores of a 2-core machine busy (about 8.5
# minutes there against 16 in one process). Work stealing evens out the long tests at the end.
# Arguments come after, so `bash scripts/test.sh -n 0 tests/test_cli.py` runs in this process.
python -m pytest -q -n 2 --dist worksteal "$@"
