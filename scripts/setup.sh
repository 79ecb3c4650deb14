#!/usr/bin/env bash
# Create .venv (if missing) and install graft-rl with its test tools, CPU torch pinned.
# GPU users: create your venv with your own torch and run  pip install -e ".[test]"  instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c requirements/cpu.txt -e ".[test]"
