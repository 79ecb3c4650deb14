"""``graft config init [PATH]``: a commented starter config for "two models, my data, my reward" (docs/tasks.md).

The file names every key a new task needs, with its default and what to put there; ``graft config
show SECTION`` lists the rest. It loads as written (``--data``/``--reward``/``--models`` fill the
placeholders), so ``graft probe PATH`` is the next command.
"""

from __future__ import annotations

import json
from pathlib import Path

from graft_rl.errors import DOCS, ConfigError
from graft_rl.methods import method_names

__all__ = ["starter", "write_starter"]

TEMPLATE = """\
# graft-rl: two models, your data, your reward ({docs}tasks/). Written by `graft config init`.
# Next: `graft probe {path}` says whether the pair will exchange; then `graft train {path}`.
# Every other key, with its default and meaning: `graft config show [run|data|validation|method|policies|tracking]`.
run_dir: runs/{stem}       # where the run writes: config, metrics.jsonl, records, checkpoints, best/
seed: 0
steps: 100                 # optimisation steps (or leave out for `epochs` passes over the data)
prompt_batch: 32           # prompts per step (the paper: 128)
minibatch: 8               # prompts per minibatch (peer-last order within a step)
n: 8                       # responses per prompt per model
temperature: 1.0
max_new_tokens: 512        # per response (clamped to each model's context)
checkpoint_every: 50

data:
  # your prompts: a .parquet / .csv / .json / .jsonl file, a save_to_disk folder, or hf:ORG/NAME[:CONFIG][:SPLIT]
  train: {data}
  # your column names for our fields (problem, answer; id, subject optional). Delete what matches already.
  # Your columns keep their names too: the reward gets every column of the row.
  columns: {{problem: question, answer: answer}}
  # your reward: path/to/file.py:function or module:function, with
  #   def reward(responses: list[str], problems: list[dict]) -> list[float]
  # run in worker processes, one response per call, under verify_timeout (built-ins: math, gsm8k, gym)
  reward: {reward}
  success_threshold: 1.0   # a response succeeds (what GRAFT's all-fail / mixed selection counts) at reward >= this
  verify_timeout: 5.0      # seconds per response, hard: a call that hangs scores 0 and is counted

validation:
  # held-out sets: names/paths, or {{data: PATH, name: LABEL, reward: REWARD, columns: {{...}}}};
  # a set without a reward of its own uses data.reward. Empty: no validation, no best/ checkpoints
  data: []
  every: 10
  samples: 4

method:
  name: graft              # {methods}  (graft config show METHOD)
  delta: 0.8               # the compatibility gate: a peer response counts fully at s >= delta

report_to: []              # tensorboard | wandb | mlflow | trackio (W&B offline without an API key; MLflow in RUN_DIR/mlruns)

policies:                  # two (or more) models; each keeps its own tokenizer and chat template
- name: A
  model: {model_a}         # a Hugging Face id or local directory, a .gguf file, or zoo:NAME
  lr: 1.0e-6
  # prompt_suffix is appended to every problem (default: the paper's \\boxed{{}} instruction); null for none
  prompt_suffix: {suffix}
- name: B
  model: {model_b}
  lr: 1.0e-6
  prompt_suffix: {suffix}
"""


def starter(path: str, data: str | None = None, reward: str | None = None, models: list[str] | None = None) -> str:
    a, b = models if models else ("zoo:smollm2-135m-instruct", "zoo:gemma3-270m")
    suffix = json.dumps("Give the final answer within \\boxed{}.")
    return TEMPLATE.format(
        docs=DOCS,
        path=path,
        stem=Path(path).stem,
        data=data or "my_data.parquet",
        reward=reward or "my_reward.py:reward",
        model_a=a,
        model_b=b,
        suffix=suffix,
        methods=" | ".join(method_names()),
    )


def write_starter(
    path: str, data: str | None = None, reward: str | None = None, models: list[str] | None = None, force: bool = False
) -> Path:
    """Write the starter config; an existing file is kept unless ``force`` (one line saying so)."""
    out = Path(path)
    if out.exists() and not force:
        raise ConfigError(f"graft config init: {out} exists; give another path or --force to replace it")
    if models is not None and len(models) != 2:
        raise ConfigError(f"graft config init: --models takes two models, got {len(models)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(starter(path, data, reward, models))
    return out


def write_from_preset(path: str, preset: str, force: bool = False) -> Path:
    """``graft config init PATH --from PRESET``: the preset (or any config file) as one self-contained
    file, its ``base:`` chain merged in, headed by the preset's own comments; the result loads to the
    same config as the preset."""
    import yaml

    from graft_rl import __version__
    from graft_rl.engine.config import load_config, read_config_file
    from graft_rl.engine.presets import resolve

    out = Path(path)
    if out.exists() and not force:
        raise ConfigError(f"graft config init: {out} exists; give another path or --force to replace it")
    source, _ = resolve(preset)
    data = read_config_file(preset)
    head = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    head.append(f"# Written by `graft config init {path} --from {preset}` (graft-rl {__version__}): the base: chain")
    head.append("# merged into this one file; every key can be edited here (graft config show: what each means).")
    text = "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    load_config(yaml.safe_load(text))  # what is written loads (a preset's plugins included)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
