"""Low-rank adapters on a frozen base (``policies.N.lora``; `graft config show policies`; docs/design.md "LoRA policies").

A LoRA policy trains only the adapter matrices of :mod:`peft` (Hu et al., 2021): every targeted linear
layer computes ``W x + (alpha / r) B A x`` with ``W`` frozen. What this module adds to peft:

- :class:`LoraSettings`: the config block, checked in one line (a non-zero dropout is refused: a
  policy must be a deterministic function of its weights at scoring time, or the on-policy ratio of
  GRAFT's Eq. 5 is no longer 1).
- :func:`attach`: adapters on a loaded base, initialised from a fixed seed (the same adapters on
  every rank and every run, whatever the global RNG), their masters in float32 while the base stays
  frozen in the compute dtype; or a saved adapter loaded back, trainable.
- :class:`MergedState`: the model under its *own* names with every adapted weight merged,
  ``W + (alpha / r) B A`` computed out of place in float32 and cast to ``W``'s dtype, one tensor at a
  time. It is what a vLLM engine is pushed and verified against (the merge never touches the
  trainer's weights: merging and unmerging in place would move a bf16 base at every step).
- :func:`base_digest`: a digest of the frozen base, saved with every adapter checkpoint, so an
  adapter is never resumed or evaluated on another base.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from graft_rl.policy.types import PolicyError

__all__ = [
    "ADAPTER_CONFIG",
    "LORA_SEED",
    "LoraSettings",
    "MergedState",
    "attach",
    "base_digest",
    "is_adapter_dir",
    "require_peft",
    "save_adapter",
]

#: peft's adapter configuration file, present in every adapter checkpoint.
ADAPTER_CONFIG = "adapter_config.json"

#: Seed of the adapters' initialisation (``lora_A``'s Kaiming draw; ``lora_B`` starts at zero).
LORA_SEED = 0

_ADAPTER = "default"  # peft's adapter name


@dataclass(frozen=True)
class LoraSettings:
    """``policies.N.lora``: rank ``r``, scale ``alpha / r``, the layers adapted.

    ``target_modules``: ``all-linear`` (every linear layer but the LM head, peft's meaning) or a list
    of module names (``[q_proj, v_proj]``). ``dropout`` exists only to be refused when non-zero.
    """

    r: int = 16
    alpha: float = 32.0
    target_modules: str | list[str] = "all-linear"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise PolicyError(f"lora.r must be an integer >= 1, got {self.r!r}")
        if not (0 < float(self.alpha) < math.inf):
            raise PolicyError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if self.dropout != 0:
            raise PolicyError(
                f"lora.dropout must be 0, got {self.dropout!r}: a policy must score its own samples "
                "deterministically (a dropout would make the on-policy ratio differ from 1)"
            )
        t = self.target_modules
        if isinstance(t, str):
            if t != "all-linear":
                raise PolicyError(f"lora.target_modules must be 'all-linear' or a list of module names, got {t!r}")
        elif not (isinstance(t, (list, tuple)) and t and all(isinstance(x, str) and x for x in t)):
            raise PolicyError(f"lora.target_modules must be 'all-linear' or a list of module names, got {t!r}")
        else:
            object.__setattr__(self, "target_modules", list(t))

    @classmethod
    def of(cls, value) -> LoraSettings | None:
        """``value`` as settings: None, a mapping (a config or a saved ``graft_policy.json``) or settings."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise PolicyError(f"lora must be a mapping {{r, alpha, target_modules}} or null, got {value!r}")
        unknown = sorted(set(value) - {"r", "alpha", "target_modules", "dropout"})
        if unknown:
            raise PolicyError(f"lora: unknown key {unknown[0]!r} (have: r, alpha, target_modules, dropout)")
        return cls(**value)

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.r


def require_peft():
    try:
        import peft
    except ImportError:
        raise PolicyError("lora needs the peft library: pip install 'graft-rl[lora]'") from None
    return peft


def is_adapter_dir(path: str | Path) -> bool:
    """A saved adapter (peft's ``adapter_config.json``), not a full model directory."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def attach(model: torch.nn.Module, settings: LoraSettings | None, adapter_dir: Path | None, master_dtype: torch.dtype):
    """Adapters on ``model`` (frozen from here on): new ones from ``settings``, or the saved ones in
    ``adapter_dir`` (trainable). Returns the :class:`peft.PeftModel`; ``model`` itself now holds the
    adapted layers and is what the policy scores and trains with."""
    import warnings

    peft = require_peft()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing, and notes GPT-2's Conv1D layout
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        torch.manual_seed(LORA_SEED)
        if adapter_dir is not None:
            wrapped = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
        else:
            assert settings is not None
            cfg = peft.LoraConfig(
                r=settings.r,
                lora_alpha=settings.alpha,
                target_modules=settings.target_modules,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            )
            try:
                wrapped = peft.get_peft_model(model, cfg)
            except ValueError as exc:
                raise PolicyError(f"lora.target_modules: {str(exc).splitlines()[0]}") from None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, layer in lora_layers(model).items():  # linear layers only (refused in one line otherwise)
        if head is not None and layer is head:
            raise PolicyError(
                f"lora.target_modules: {name} is the LM head; adapt the decoder's linear layers "
                "(all-linear leaves the head out; a head tied to the embeddings cannot hold a merged copy)"
            )
    for name, p in model.named_parameters():
        if p.requires_grad:
            if ".lora_" not in name:
                raise PolicyError(f"lora: {name} is trainable but is not an adapter weight")
            p.data = p.data.to(master_dtype)  # the adapters' masters (and so their Adam state)
    return wrapped


def save_adapter(wrapped, out: Path, state_dict: dict | None = None) -> None:
    """peft's ``adapter_model.safetensors`` + ``adapter_config.json`` (no model card: the checkpoint's
    files are graft-rl's manifest's). ``state_dict``: a sharded policy's gathered state, peft's names."""
    import warnings

    with warnings.catch_warnings():  # a GGUF or hub base has no config.json for peft to compare vocabularies with
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
        wrapped.save_pretrained(str(out), state_dict=state_dict)
    (Path(out) / "README.md").unlink(missing_ok=True)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{own module name: peft LoRA layer}``; every adapted layer must be a linear one."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            if not isinstance(m, Linear):
                raise PolicyError(f"lora: {name} is a {type(m).__name__}; only linear layers can be adapted here")
            out[name] = m
    return out


def _own_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


class MergedState(Mapping):
    """The model's state under its own names, each adapted weight merged when read (:func:`merged_weight`).

    ``tensor(name)`` reads the raw (peft-named) state: ``lambda n: state[n]`` on one process, a gathered
    full tensor on a sharded one. Unadapted tensors are returned as they are (tied embeddings keep
    sharing their storage, so :func:`~graft_rl.policy.pushcheck.tied_names` still finds them)."""

    def __init__(self, model: torch.nn.Module, tensor=None):
        state = model.state_dict()
        self._tensor = tensor or state.__getitem__
        self._layers = {f"{n}.weight": m for n, m in lora_layers(model).items()}
        self._names: dict[str, str] = {}  # own name -> raw name
        for raw in state:
            if ".lora_" in raw:
                continue
            self._names[_own_name(raw)] = raw

    def __getitem__(self, name: str) -> torch.Tensor:
        raw = self._names[name]
        w = self._tensor(raw)
        layer = self._layers.get(name)
        if layer is None:
            return w
        prefix = raw[: -len("base_layer.weight")]
        a = self._tensor(f"{prefix}lora_A.{_ADAPTER}.weight")
        b = self._tensor(f"{prefix}lora_B.{_ADAPTER}.weight")
        return merged_weight(w, a, b, layer.scaling[_ADAPTER], layer.fan_in_fan_out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@torch.no_grad()
def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, transpose: bool = False):
    """``W + scale * B A`` computed in float32, out of place, cast to ``W``'s dtype."""
    delta = b.detach().float() @ a.detach().float()
    if transpose:
        delta = delta.T
    return (w.detach().float() + scale * delta).to(w.dtype)


@torch.no_grad()
def base_digest(model: torch.nn.Module) -> str:
    """sha256 over the frozen base's tensors: own names, shapes and the row digests of their values in
    bfloat16 (:func:`~graft_rl.policy.pushcheck.row_digest`), so the same base loaded in float32 or
    bfloat16 (another ``dtype`` at ``graft eval`` or resume) has the same digest. A guard against another
    base, not a cryptographic fingerprint of the weights."""
    from graft_rl.policy.pushcheck import row_digest

    h = hashlib.sha256()
    for raw, t in model.state_dict().items():
        if ".lora_" in raw:
            continue
        local = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(json.dumps([_own_name(raw), list(local.shape)]).encode())
        h.update(row_digest(local, torch.bfloat16 if local.is_floating_point() else None).numpy().tobytes())
    return h.hexdigest()
