"""``graft export RUN_DIR --merged OUT``: a trained policy as a plain Hugging Face model directory.

A LoRA policy's checkpoint holds its adapter only (policy.lora); exported, every adapted weight is
merged, ``W + (alpha / r) B A`` in float32 cast to the base's dtype (the tensors its vLLM engine was
pushed), into a ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained`` loads
without graft-rl or peft. A full fine-tuning checkpoint is written out the same way. Its
``graft_policy.json`` keeps the policy's prompt format, so ``graft eval OUT`` prompts it as trained.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from graft_rl.policy import Policy
from graft_rl.policy.loading import load_model, resolve_model
from graft_rl.policy.training import POLICY_SETTINGS
from graft_rl.policy.types import PolicyError

__all__ = ["export_merged"]


def export_merged(target: str, out: str | Path, policy: str | None = None) -> list[tuple[str, Path]]:
    """Write each policy of ``target`` (a run directory: its best checkpoints, else the latest; or a
    checkpoint's policy directory) to ``out`` (one policy) or ``out/<name>`` (several).
    ``[(name, directory)]``; an existing non-empty ``out`` is refused (nothing is overwritten)."""
    from graft_rl.commands.evaluate_cli import resolve_targets

    targets = resolve_targets(target, policy)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PolicyError(f"{out} exists and is not an empty directory; export writes a new one")
    written = []
    for pc in targets:
        dest = out if len(targets) == 1 else out / pc.name
        written.append((pc.name, _export_one(replace(pc, backend="hf", device="cpu"), dest)))
    return written


def _export_one(pc, dest: Path) -> Path:
    pol = Policy(pc)
    if pol.lora is None:
        model = pol.model
    else:
        assert pol.base is not None
        path, gguf = resolve_model(pol.name, pol.base["model"], pol.base.get("gguf_file"))
        model = load_model(pol.name, path if path.exists() else pol.base["model"], gguf, pol.compute_dtype)
        merged = pol.rollout_state()
        model.load_state_dict({n: merged[n] for n in merged}, strict=True)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    pol.tokenizer.save_pretrained(dest)
    pol.save_settings(dest)
    settings = json.loads((dest / POLICY_SETTINGS).read_text())
    settings = {k: v for k, v in settings.items() if k not in ("lora", "lora_base")}  # a plain model now
    (dest / POLICY_SETTINGS).write_text(json.dumps(settings, indent=1))
    return dest
