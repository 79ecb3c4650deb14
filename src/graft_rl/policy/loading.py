"""Where a policy's weights come from (docs/design.md, layer 3): a model path, GGUF file, ``zoo:`` name or
hub id resolved and loaded in its dtype; for a LoRA policy (policy.lora) its base frozen in the compute
dtype with new adapters, or a saved adapter back on the base it was trained on (checked by digest)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graft_rl.policy import zoo
from graft_rl.policy.lora import LoraSettings, attach, base_digest, is_adapter_dir
from graft_rl.policy.types import PolicyError

__all__ = ["Loaded", "is_hub_id", "load_model", "load_policy_model", "load_tokenizer", "resolve_model"]


def is_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id, fetched by transformers where a network allows it)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not Path(name.split("/")[0]).exists()


def resolve_model(who: str, model: str, gguf: str | None) -> tuple[Path, str | None]:
    """``(directory, gguf file or None)`` of a model path, GGUF file, ``zoo:`` name or hub id; ``who``
    names the policy in errors."""
    try:
        path = Path(zoo.resolve(model)).expanduser()
    except FileNotFoundError as exc:
        raise PolicyError(f"policy {who!r}: {exc}") from None
    if not path.exists() and not is_hub_id(model):
        raise PolicyError(f"policy {who!r}: model path {model!r} does not exist")
    if gguf is None and path.is_file() and path.suffix == ".gguf":
        path, gguf = path.parent, path.name
    return path, gguf


def _gguf_tokenizer_cache(gguf_path: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: the conversion (transformers rebuilding a fast
    tokenizer from the GGUF vocabulary) takes 4 s for SmolLM2's 49k tokens and 15 s for Gemma 3's
    262k (AMD EPYC, 2 cores, transformers 5.25; reading the saved one back: 0.3 s and 2.5 s; timed by
    calling this twice with an empty ``GRAFT_RL_CACHE``), and every load of the model would pay it again. Keyed by the file (path, size,
    modification time) and the transformers and tokenizers versions that converted it."""
    import hashlib

    import tokenizers
    import transformers

    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{tokenizers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return zoo.cache_dir() / "gguf_tokenizers" / f"{gguf_path.stem}-{digest}"


def load_tokenizer(path: Path | str, gguf: str | None):
    """A tokenizer from a model directory or hub id, or converted from a GGUF file; a GGUF file's
    conversion is done once and kept (:func:`_gguf_tokenizer_cache`), so a later load reads the saved
    fast tokenizer (the same vocabulary, merges, special tokens and chat template). Raises what
    transformers raises."""
    from transformers import AutoTokenizer

    if not gguf or not (Path(path) / gguf).is_file():
        return AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    cached = _gguf_tokenizer_cache(Path(path) / gguf)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a cache written by another version or cut short: convert again
            pass
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    _keep(tokenizer, cached)
    return tokenizer


def _keep(tokenizer, cached: Path) -> None:
    """Save ``tokenizer`` at ``cached``: written beside, then renamed, so a reader never sees half a
    directory; a writer that loses a race to another, or a cache that cannot be written, leaves
    things as they were (the next load converts again)."""
    import shutil
    import tempfile

    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".writing-"))
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(cached, ignore_errors=True)  # one a failed load found unreadable
        tmp.rename(cached)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(who: str, path: Path | str, gguf: str | None, dtype: torch.dtype):
    """A causal LM in ``dtype`` (a GGUF file dequantised to it)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=dtype)
    except Exception as exc:
        raise PolicyError(f"policy {who!r}: cannot load model from {path}: {type(exc).__name__}: {exc}") from None
    if gguf:  # a dequantised GGUF model: drop the quantizer marker so save_pretrained works
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
    return model


@dataclass
class Loaded:
    """A policy's model as loaded: ``lora`` the peft model around ``model`` (None: full fine-tuning),
    ``base`` a LoRA policy's ``{model, gguf_file, digest}``, ``model_dir`` what a vLLM engine loads,
    ``settings`` the LoRA settings (a saved adapter's when the config gives none)."""

    model: Any
    lora: Any = None
    base: dict | None = None
    model_dir: Path | None = None
    settings: LoraSettings | None = None


def load_policy_model(config, path: Path, gguf: str | None, compute: torch.dtype, master: torch.dtype) -> Loaded:
    """The model of ``config`` at the resolved ``path``: in the master dtype (full fine-tuning), or a
    base frozen in the compute dtype with adapters whose masters are in the master dtype."""
    where = path if path.exists() else config.model
    if is_adapter_dir(path):
        return _load_adapter(config, path, compute, master)
    if config.lora is None:
        return Loaded(load_model(config.name, where, gguf, master), model_dir=path)
    model = load_model(config.name, where, gguf, compute)
    # a zoo: name stays a name (the package may move); a path becomes absolute; a hub id stays an id
    named = config.model.startswith("zoo:") or not path.exists()
    base = {"model": config.model if named else str(path.absolute()), "gguf_file": None if named else gguf}
    base["digest"] = base_digest(model)
    return Loaded(model, attach(model, config.lora, None, master), base, path, config.lora)


def _load_adapter(config, path: Path, compute: torch.dtype, master: torch.dtype) -> Loaded:
    """A saved adapter (``Policy.save`` of a LoRA policy) on the base it was trained on: that base's
    digest must match the one saved, or the policy is refused in one line."""
    from graft_rl.policy.training import POLICY_SETTINGS

    try:
        saved = json.loads((path / POLICY_SETTINGS).read_text())
        base = saved["lora_base"]
    except (OSError, ValueError, KeyError, TypeError):
        raise PolicyError(
            f"policy {config.name!r}: {path} holds an adapter but no {POLICY_SETTINGS} naming its base model; "
            "only adapters graft-rl saved can be loaded"
        ) from None
    base_path, gguf = resolve_model(config.name, base["model"], base.get("gguf_file"))
    model = load_model(config.name, base_path if base_path.exists() else base["model"], gguf, compute)
    digest = base_digest(model)
    if digest != base.get("digest"):
        raise PolicyError(
            f"policy {config.name!r}: the adapter in {path} was trained on another base than {base['model']} "
            f"holds now (base digest {str(base.get('digest'))[:12]}, now {digest[:12]}); refused"
        )
    settings = config.lora or LoraSettings.of(saved.get("lora"))
    return Loaded(model, attach(model, None, path, master), {**base, "digest": digest}, base_path, settings)
