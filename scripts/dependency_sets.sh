#!/usr/bin/env bash
# The fast test tier against one dependency set, in its own venv (.venv-<set>):
#   bash scripts/dependency_sets.sh oldest   # pyproject's floors (requirements/oldest.txt)
#   bash scripts/dependency_sets.sh newest   # the newest releases pip resolves today (no constraint but cpu.txt)
# Prints the versions it ran with and the install and test times; the last results are recorded in
# docs/contributing.md ("Dependency floors"). torch is the pinned CPU build in both (requirements/cpu.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
SET=${1:?usage: dependency_sets.sh oldest|newest}
VENV=.venv-$SET
PY=${PYTHON:-python3}
start=$SECONDS
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
"${PIP[@]}" install --upgrade pip
CONSTRAINTS=(-c requirements/cpu.txt)
if [ "$SET" = oldest ]; then CONSTRAINTS+=(-c requirements/oldest.txt); fi
"${PIP[@]}" install "${CONSTRAINTS[@]}" -e ".[test,gguf,ray,lora,docs]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import graft_rl.algo, graft_rl.policy"
install=$((SECONDS - start))
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
names = ["torch", "transformers", "tokenizers", "safetensors", "pyarrow", "numpy", "datasets", "ray", "peft",
         "accelerate", "math-verify", "reasoning-gym", "matplotlib", "mkdocs", "mkdocs-material", "mkdocstrings",
         "mkdocstrings-python"]
print("versions: " + ", ".join(f"{n} {m.version(n)}" for n in names))
PY
start=$SECONDS
"$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider
echo "dependency set $SET: install ${install} s, fast tier $((SECONDS - start)) s"
