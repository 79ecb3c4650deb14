"""A CPU testbed where GRAFT's effect can be measured in minutes (beyond the paper's GPU scale).

The task family: procedurally generated multi-step integer arithmetic with a step-by-step
solution and a ``\\boxed{}`` answer, e.g. ``Q: 8*11-62=?`` / ``A: 8*11=88. 88-62=26. \\boxed{26}``.

The pair differs the way the paper's pairs do:

- **A**: Llama-like (RoPE, RMSNorm, SwiGLU), a byte-level tokenizer (one token per
  character), "pretrained" mostly on additions and subtractions;
- **B**: GPT-2-like (learned positions, LayerNorm, GELU), a byte-level BPE trained on the
  task text, "pretrained" mostly on products.

"Pretraining" is a short supervised warm-up on each model's own mixture (different seeds),
so their successes are complementary. The pair is built once from a seed by
``scripts/build_testbed.py`` and ships in the package (``graft_rl/testbed_files``: floating-point
differences between CPUs compound over the warm-up, so building it on each machine would give each
user different models); :func:`ensure_testbed` still builds one anywhere, e.g. with other settings.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TASKS", "make_problem", "make_split", "Testbed", "ensure_testbed", "shipped_testbed", "warm_up", "PLAIN_TEMPLATE",
           "SHIPPED_ROOT"]

#: Where the shipped build lives inside the package (``scripts/build_testbed.py`` writes it).
SHIPPED_ROOT = Path(__file__).resolve().parent / "testbed_files"

#: Prompt format of both testbed models (plain text, no chat template).
PLAIN_TEMPLATE = "Q: {prompt}\nA: "

TASKS = ("add", "sub", "add3", "mul", "muladd")


def make_problem(kind: str, rng: random.Random) -> tuple[str, str, str]:
    """``(expression, solution, answer)`` for one problem of ``kind``."""
    if kind == "add":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a}+{b}=?", f"{a}+{b}={a + b}. \\boxed{{{a + b}}}", str(a + b)
    if kind == "sub":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a}-{b}=?", f"{a}-{b}={a - b}. \\boxed{{{a - b}}}", str(a - b)
    if kind == "add3":
        a, b, c = rng.randint(0, 12), rng.randint(0, 12), rng.randint(0, 12)
        s = a + b
        return f"{a}+{b}-{c}=?", f"{a}+{b}={s}. {s}-{c}={s - c}. \\boxed{{{s - c}}}", str(s - c)
    if kind == "mul":
        a, b = rng.randint(2, 15), rng.randint(2, 9)
        return f"{a}*{b}=?", f"{a}*{b}={a * b}. \\boxed{{{a * b}}}", str(a * b)
    if kind == "muladd":
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(0, 12)
        p = a * b
        return f"{a}*{b}+{c}=?", f"{a}*{b}={p}. {p}+{c}={p + c}. \\boxed{{{p + c}}}", str(p + c)
    raise ValueError(f"unknown testbed task {kind!r}; available: {', '.join(TASKS)}")


def make_split(
    n: int, seed: int, mixture: dict[str, float] | None = None, prefix: str = "tb", unique: bool = True
) -> list[dict]:
    """``n`` problems (dataset rows with ``solution``), kinds drawn from ``mixture`` (uniform by default).

    With ``unique`` no expression repeats (the task space is finite: keep ``n`` well below it).
    """
    rng = random.Random(seed)
    kinds = list(mixture) if mixture else list(TASKS)
    weights = [mixture[k] for k in kinds] if mixture else None
    rows, seen = [], set()
    while len(rows) < n:
        kind = rng.choices(kinds, weights)[0]
        expr, sol, ans = make_problem(kind, rng)
        if unique and expr in seen:
            continue
        seen.add(expr)
        rows.append({"id": f"{prefix}-{len(rows)}", "problem": expr, "answer": ans, "solution": sol, "subject": kind})
    return rows


#: Warm-up mixtures: complementary strengths (A: additive, B: multiplicative).
MIXTURE_A = {"add": 0.35, "sub": 0.35, "add3": 0.25, "mul": 0.03, "muladd": 0.02}
MIXTURE_B = {"add": 0.15, "sub": 0.02, "add3": 0.03, "mul": 0.45, "muladd": 0.35}


def _corpus_text(rows: list[dict]) -> list[str]:
    return [PLAIN_TEMPLATE.replace("{prompt}", r["problem"]) + r["solution"] for r in rows]


def warm_up(model_dir: Path, rows: list[dict], steps: int, seed: int, lr: float = 3e-3, batch: int = 32) -> dict:
    """Supervised warm-up ("pretraining") on prompt -> solution, loss on solution tokens only.

    A fixed number of steps (not a time budget), so a build is reproducible from its seed on
    any machine, however loaded.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_rl.policy.policy import _quiet_transformers

    _quiet_transformers()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    enc = []
    for r in rows:
        p = tok(PLAIN_TEMPLATE.replace("{prompt}", r["problem"]), add_special_tokens=False).input_ids
        s = tok(r["solution"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        enc.append((p, s))
    rng = random.Random(seed)
    t0, loss_ema = time.perf_counter(), None
    for step in range(steps):
        chunk = rng.sample(enc, min(batch, len(enc)))
        L = max(len(p) + len(s) for p, s in chunk)
        ids = torch.full((len(chunk), L), tok.pad_token_id)
        labels = torch.full((len(chunk), L), -100)
        attn = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, (p, s) in enumerate(chunk):
            seq = p + s
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(s)
            attn[i, : len(seq)] = 1
        frac = step / max(steps, 1)
        for g in opt.param_groups:  # linear decay to 10%
            g["lr"] = lr * (1 - 0.9 * frac)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
    model.eval()
    model.save_pretrained(model_dir)
    return {"steps": steps, "loss": loss_ema, "seconds": time.perf_counter() - t0}


@dataclass
class Testbed:
    """A built testbed: two model directories and two JSONL files under ``root``.

    ``shipped``: the build that ships inside the package (``graft_rl/testbed_files``, see
    :func:`shipped_testbed`); configs then name it ``zoo:testbed-a`` / ``zoo:testbed-b`` /
    ``testbed_train`` / ``testbed_heldout`` instead of paths, so they work on any machine.
    """

    root: Path
    shipped: bool = False

    @property
    def model_a(self) -> Path:
        return self.root / "model_a"

    @property
    def model_b(self) -> Path:
        return self.root / "model_b"

    @property
    def train_file(self) -> Path:
        return self.root / "train.jsonl"

    @property
    def eval_file(self) -> Path:
        return self.root / "heldout.jsonl"

    def refs(self) -> dict[str, str]:
        """How a config names this build's models and data."""
        if self.shipped:
            return {"A": "zoo:testbed-a", "B": "zoo:testbed-b", "train": "testbed_train", "heldout": "testbed_heldout"}
        return {"A": str(self.model_a), "B": str(self.model_b), "train": str(self.train_file), "heldout": str(self.eval_file)}

    def policy_dicts(self, lr: float = 1e-4) -> list[dict]:
        common = {"prompt_format": "plain", "plain_template": PLAIN_TEMPLATE, "prompt_suffix": None, "lr": lr}
        refs = self.refs()
        return [{"name": "A", "model": refs["A"], **common}, {"name": "B", "model": refs["B"], **common}]

    def train_config(self, run_dir: str = "runs/demo", method: str = "graft") -> dict:
        """The embedded default of ``graft train``: GRAFT on this pair, a few minutes on 2 cores."""
        return {
            "run_dir": run_dir,
            "seed": 0,
            "steps": 60,
            "prompt_batch": 32,
            "minibatch": 8,
            "n": 8,
            "max_new_tokens": 40,
            "checkpoint_every": 30,
            "data": {"train": self.refs()["train"], "verifier": "gsm8k"},
            "validation": {"data": self.refs()["heldout"], "every": 30, "samples": 4, "limit": 256, "temperature": 1.0,
                           "top_p": 1.0, "max_new_tokens": 40},
            "method": {"name": method},
            "policies": self.policy_dicts(),
        }


#: Warm-up steps (batch 32) of A and B: the byte-level model learns more slowly, so it gets more.
#: About 2 and 1 minutes on 2 CPU cores.
WARMUP_STEPS = (1835, 842)

#: Bumped whenever the build procedure changes what it produces for the same arguments, so a
#: cached build from an older procedure is rebuilt instead of silently reused.
BUILD_VERSION = 2


def ensure_testbed(root: str | Path, seed: int = 0, warmup_steps: tuple[int, int] = WARMUP_STEPS, pool: int = 1000,
                   heldout: int = 512, progress: bool = True) -> Testbed:
    """Build (once) the pair and the data under ``root``; later calls return the cached build."""
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model, char_tokenizer

    tb = Testbed(Path(root))
    done = tb.root / "testbed.json"
    build = {"version": BUILD_VERSION, "seed": seed, "warmup_steps": list(warmup_steps), "pool": pool, "heldout": heldout}
    if done.is_file():
        try:
            cached = json.loads(done.read_text()).get("build")
        except (json.JSONDecodeError, AttributeError):
            cached = None
        if cached == build:
            return tb
        if progress:
            print(f"testbed: the cached build in {tb.root} was made with other settings ({cached} != {build}); rebuilding",
                  flush=True)
        done.unlink()  # only this build's own files are replaced below
    tb.root.mkdir(parents=True, exist_ok=True)
    train = make_split(pool, seed, prefix="train")
    held = [r for r in make_split(pool + heldout * 2, seed + 1, prefix="heldout") if r["problem"] not in {t["problem"] for t in train}]
    held = held[:heldout]
    for path, rows in ((tb.train_file, train), (tb.eval_file, held)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    warm_a = make_split(20000, seed + 2, MIXTURE_A, prefix="wa", unique=False)
    warm_b = make_split(20000, seed + 3, MIXTURE_B, prefix="wb", unique=False)
    train_exprs = {r["problem"] for r in train} | {r["problem"] for r in held}
    warm_a = [r for r in warm_a if r["problem"] not in train_exprs]
    warm_b = [r for r in warm_b if r["problem"] not in train_exprs]
    bpe = bpe_tokenizer(_corpus_text(make_split(3000, seed + 4, prefix="c", unique=False)), vocab_size=320)
    build_tiny_model(tb.model_a, "llama", char_tokenizer(chat_template=None), hidden=128, layers=2, heads=4, seed=seed)
    build_tiny_model(tb.model_b, "gpt2", bpe, hidden=128, layers=2, heads=4, seed=seed + 1)
    info = {}
    for name, path, rows, s, steps in (("A", tb.model_a, warm_a, seed + 5, warmup_steps[0]),
                                       ("B", tb.model_b, warm_b, seed + 6, warmup_steps[1])):
        if progress:
            print(f"testbed: warming up model {name} ({steps} steps, about {steps // 15} s on 2 cores)...", flush=True)
        info[name] = warm_up(path, rows, steps, s)
    done.write_text(json.dumps({"build": build, "warmup": info, "heldout_rows": len(held)}, indent=1))
    return tb


def shipped_testbed() -> Testbed:
    """The testbed pair that ships with graft-rl (built once by ``scripts/build_testbed.py``, sha256
    and held-out accuracy recorded in ``testbed_files/testbed.json``): the same weights on every
    machine, nothing to build."""
    tb = Testbed(SHIPPED_ROOT, shipped=True)
    if not (tb.root / "testbed.json").is_file():
        raise FileNotFoundError(f"{tb.root}: the shipped testbed is missing; reinstall graft-rl or run scripts/build_testbed.py")
    return tb
