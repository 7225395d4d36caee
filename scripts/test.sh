#!/usr/bin/env bash
# Set everything up, then run the whole test suite (CPU only; no network, no model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${VIRTUAL_ENV:-}" ]; then . .venv/bin/activate; fi
python -m pytest -q "$@"
