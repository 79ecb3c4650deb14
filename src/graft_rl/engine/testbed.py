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

Three pairs ship (:data:`PAIRS`):

- ``natural``: the mixtures above; every task kind in the prompt pool. Their strengths overlap
  and GRAFT's effect on it is within noise (docs/benchmarks.md, "CPU testbed").
- ``transfer``: *constructed to expose the mechanism*. Both models share the primitives (small
  additions, subtractions, chains); A has two-digit chains ``a+b-c`` (``add3_hi``) and products by
  2-5 only; B has every product and ``a*b+c`` with ``b`` in 6-9 (``muladd_hi``) but no two-digit
  chains. The prompt pool holds just those two families, so each model faces one it solves
  about half the time and one where nearly all its groups fail (A ~1 % on ``muladd_hi``, B ~2 %
  on ``add3_hi``) while the peer's groups are mixed: the paper's complementary prompts, by design.
  ``graft train`` without a config runs GRAFT on this pair.
- ``lookup``: the smallest setting in which the mechanism must show, for the end-to-end check
  (:func:`build_lookup_pair`). The answer is one digit read from a key in the
  prompt, ``Q: T3 kqzv`` / ``A: \\boxed{6}, as we look up the key ...`` (a fixed sentence after the
  answer: the response is long, the difference between models sits on one token, so the gate
  admits while the receiver's groups all fail). A was *taught a wrong rule* for family ``shift3``
  and then sharpened (confidently wrong: no sample of a run is expected to be right) and is right
  half the time on ``shift6``; B the other way round. The prompt pool holds only ``shift3``, A's
  missing family: there GRPO gives A no gradient at all, GRAFT gives it B's mixed groups.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TASKS",
    "TRANSFER_KINDS",
    "PAIRS",
    "PairSpec",
    "make_problem",
    "make_split",
    "Testbed",
    "ensure_testbed",
    "shipped_testbed",
    "shipped_root",
    "warm_up",
    "PLAIN_TEMPLATE",
    "LOOKUP_FAMILIES",
    "lookup_response",
    "build_lookup_pair",
    "lookup_right_digit_probability",
]


#: Prompt format of both testbed models (plain text, no chat template).
PLAIN_TEMPLATE = "Q: {prompt}\nA: "

TASKS = ("add", "sub", "add3", "mul", "muladd")
#: Extra kinds of the capability-transfer pair.
TRANSFER_KINDS = ("mul_lo", "muladd_lo", "muladd_hi", "add3_hi")


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
    if kind == "mul_lo":  # the transfer pair's A: products by 2-5 only
        a, b = rng.randint(2, 15), rng.randint(2, 5)
        return f"{a}*{b}=?", f"{a}*{b}={a * b}. \\boxed{{{a * b}}}", str(a * b)
    if kind in ("muladd_lo", "muladd_hi"):  # a*b+c with b in 2-5 / 6-9
        a, b, c = rng.randint(2, 9), rng.randint(2, 5) if kind == "muladd_lo" else rng.randint(6, 9), rng.randint(0, 20)
        p = a * b
        return f"{a}*{b}+{c}=?", f"{a}*{b}={p}. {p}+{c}={p + c}. \\boxed{{{p + c}}}", str(p + c)
    if kind == "add3_hi":  # a+b-c with two-digit a, b
        a, b, c = rng.randint(10, 30), rng.randint(10, 30), rng.randint(0, 20)
        s = a + b
        return f"{a}+{b}-{c}=?", f"{a}+{b}={s}. {s}-{c}={s - c}. \\boxed{{{s - c}}}", str(s - c)
    raise ValueError(f"unknown testbed task {kind!r}; available: {', '.join(TASKS + TRANSFER_KINDS)}")


def make_split(
    n: int, seed: int, mixture: dict[str, float] | None = None, prefix: str = "tb", unique: bool = True
) -> list[dict]:
    """``n`` problems (dataset rows with ``solution``), kinds drawn from ``mixture`` (uniform by default).

    With ``unique`` no expression repeats (the task space is finite: keep ``n`` well below it).
    """
    rng = random.Random(seed)
    kinds = list(mixture) if mixture else list(TASKS)
    weights = [mixture[k] for k in kinds] if mixture else None
    rows, seen, tries = [], set(), 0
    while len(rows) < n:
        tries += 1
        if tries > 200 * n:
            raise ValueError(f"make_split: cannot draw {n} distinct problems from {kinds} (the task space is smaller)")
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

#: The transfer pair's warm-up mixtures: shared primitives; A alone has two-digit chains (add3_hi),
#: B alone products by 6-9 and their chains (mul covers b in 2-9, muladd_hi).
TRANSFER_A = {"add": 0.15, "sub": 0.15, "add3": 0.15, "add3_hi": 0.2, "mul_lo": 0.15, "muladd_lo": 0.2}
TRANSFER_B = {"add": 0.15, "sub": 0.15, "add3": 0.15, "mul": 0.15, "muladd": 0.15, "muladd_hi": 0.25}


@dataclass(frozen=True)
class PairSpec:
    """How one testbed pair is built: warm-up mixtures and steps, and the families of its prompts.

    ``families``: the kinds of the prompt pool and held-out set, equally many of each (``None``:
    every kind of :data:`TASKS`, drawn uniformly, as the natural pair has it); with families the
    held-out set holds ``heldout`` problems per family, interleaved so its first ``k`` rows are balanced.
    """

    name: str
    mixture_a: dict[str, float]
    mixture_b: dict[str, float]
    warmup_steps: tuple[int, int]
    pool: int
    heldout: int
    families: tuple[str, ...] | None = None


#: Warm-up steps (batch 32): the byte-level model A learns more slowly, so it gets more.
PAIRS: dict[str, PairSpec] = {
    "natural": PairSpec("natural", MIXTURE_A, MIXTURE_B, (1835, 842), pool=1000, heldout=512),
    "transfer": PairSpec(
        "transfer", TRANSFER_A, TRANSFER_B, (1835, 1700), pool=600, heldout=256, families=("muladd_hi", "add3_hi")
    ),
    # supervised steps (batch 64) of build_lookup_pair; the pool is A's missing family only
    "lookup": PairSpec("lookup", {}, {}, (1500, 1500), pool=64, heldout=64, families=("shift3", "shift6")),
}


def _corpus_text(rows: list[dict]) -> list[str]:
    return [PLAIN_TEMPLATE.replace("{prompt}", r["problem"]) + r["solution"] for r in rows]


def _supervised(model_dir: Path, steps: int, seed: int, lr: float, weight_decay: float, prepare) -> dict:
    """The supervised loop both builds share: AdamW, the learning rate decayed linearly to 10 %, the
    gradient norm clipped at 1, a fixed number of steps (not a time budget, so a build is
    reproducible from its seed on any machine, however loaded), then ``save_pretrained``.

    ``prepare(tok, rng)`` returns ``step_loss(model, step)``, the loss of one step's batch.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft_rl.policy.policy import _quiet_transformers

    _quiet_transformers()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    step_loss = prepare(tok, random.Random(seed))
    t0, loss_ema = time.perf_counter(), None
    for step in range(steps):
        frac = step / max(steps, 1)
        for g in opt.param_groups:  # linear decay to 10%
            g["lr"] = lr * (1 - 0.9 * frac)
        loss = step_loss(model, step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
    model.eval()
    model.save_pretrained(model_dir)
    return {"steps": steps, "loss": loss_ema, "seconds": time.perf_counter() - t0}


def _padded(tok, seqs: list[list[int]]):
    """Right-padded ``(input_ids, attention_mask)`` of token sequences."""
    import torch

    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
    return ids, attn


def warm_up(model_dir: Path, rows: list[dict], steps: int, seed: int, lr: float = 3e-3, batch: int = 32) -> dict:
    """Supervised warm-up ("pretraining") on prompt -> solution, loss on solution tokens only."""
    import torch

    def prepare(tok, rng):
        enc = []
        for r in rows:
            p = tok(PLAIN_TEMPLATE.replace("{prompt}", r["problem"]), add_special_tokens=False).input_ids
            s = tok(r["solution"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            enc.append((p, s))

        def step_loss(model, step):
            chunk = rng.sample(enc, min(batch, len(enc)))
            ids, attn = _padded(tok, [p + s for p, s in chunk])
            labels = torch.full(ids.shape, -100)
            for i, (p, s) in enumerate(chunk):
                labels[i, len(p) : len(p) + len(s)] = torch.tensor(s)
            return model(input_ids=ids, attention_mask=attn, labels=labels).loss

        return step_loss

    return _supervised(model_dir, steps, seed, lr, 0.01, prepare)


# --- The lookup pair: the smallest setting in which the mechanism must show -------------------

#: family -> (prompt mark, shift): the right answer to ``<mark><k> <nuisance>`` is ``(k + shift) % 10``.
LOOKUP_FAMILIES = {"copy": ("S", 0), "shift3": ("T", 3), "shift6": ("U", 6)}
#: What each model is taught per family: an int = a wrong shift, always (confidently wrong);
#: "half" = right half the time, else one of the nine wrong digits; absent = always right.
LOOKUP_TEACHING = {"A": {"shift3": 8, "shift6": "half"}, "B": {"shift3": "half", "shift6": 1}}
LOOKUP_TAIL = ", as we look up the key in the table and read the value written there."
#: After teaching, A's logits are scaled by this (its final RMSNorm weight): it then samples as if at
#: temperature 1/1.5. Taught alone its rare right samples on shift3 were, in some seeds, enough for
#: GRPO to learn from; sharpened, p ~ 1e-6 (:func:`lookup_right_digit_probability`).
LOOKUP_SHARPEN_A = 1.5


def lookup_response(digit: int) -> str:
    """The response format of the lookup pair: the boxed answer, then a fixed sentence."""
    return "\\boxed{" + str(digit) + "}" + LOOKUP_TAIL


def _lookup_problem(family: str, rng: random.Random) -> tuple[str, int]:
    mark, _ = LOOKUP_FAMILIES[family]
    k = rng.randrange(10)
    return f"{mark}{k} {''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(4))}", k


def _lookup_rows(families: tuple[str, ...], n: int, seed: int, prefix: str, avoid: set[str]) -> list[dict]:
    """``n`` distinct prompts, families interleaved, none in ``avoid``."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        fam = families[len(rows) % len(families)]
        expr, k = _lookup_problem(fam, rng)
        if expr in avoid:
            continue
        avoid.add(expr)
        rows.append(
            {
                "id": f"{prefix}-{len(rows)}",
                "problem": expr,
                "answer": str((k + LOOKUP_FAMILIES[fam][1]) % 10),
                "subject": fam,
            }
        )
    return rows


def _lookup_label(model: str, family: str, k: int, rng: random.Random) -> int:
    right = (k + LOOKUP_FAMILIES[family][1]) % 10
    how = LOOKUP_TEACHING[model].get(family)
    if isinstance(how, int):
        return (k + how) % 10
    if how == "half" and rng.random() >= 0.5:
        return rng.choice([d for d in range(10) if d != right])
    return right


def _lookup_teach(
    model_dir: Path, model: str, steps: int, seed: int, lr: float = 3e-3, batch: int = 64, answer_weight: float = 20.0
) -> dict:
    """Supervised teaching of one lookup model: fresh prompts and labels every step (so "half" is
    learnt as a distribution, not memorised), the answer digit's loss weighted ``answer_weight``
    times a sentence token's (otherwise the sentence dominates and the key is never read)."""
    import torch

    def prepare(tok, rng):
        def encode(expr: str, digit: int) -> tuple[list[int], list[int], int]:
            p = tok(PLAIN_TEMPLATE.replace("{prompt}", expr), add_special_tokens=False).input_ids
            text = lookup_response(digit)
            e = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            at = text.index("{") + 1
            (answer,) = [i for i, (a, b) in enumerate(e.offset_mapping) if a <= at < b]
            return p, e.input_ids + [tok.eos_token_id], answer

        def step_loss(net, step):
            rows = []
            for _ in range(batch):
                fam = rng.choice(list(LOOKUP_FAMILIES))
                expr, k = _lookup_problem(fam, rng)
                rows.append(encode(expr, _lookup_label(model, fam, k, rng)))
            ids, attn = _padded(tok, [p + r for p, r, _ in rows])
            w = torch.zeros((batch, ids.shape[1] - 1))
            for i, (p, r, answer) in enumerate(rows):
                w[i, len(p) - 1 : len(p) + len(r) - 1] = 1.0  # positions that predict response tokens
                w[i, len(p) - 1 + answer] = answer_weight
            logits = net(input_ids=ids, attention_mask=attn).logits[:, :-1]
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            return (ce.view_as(w) * w).sum() / w.sum()

        return step_loss

    return _supervised(model_dir, steps, seed, lr, 0.0, prepare)


def build_lookup_pair(
    tb: Testbed, seed: int, steps: tuple[int, int], pool: int, heldout: int, progress: bool = True
) -> dict:
    """Build the lookup pair into ``tb.root`` (:data:`LOOKUP_TEACHING`): A a Llama-like model with a
    byte-level tokenizer, B a GPT-2-like one with a BPE trained on the task text (hidden 64, 2 layers
    each); the pool is ``pool`` prompts of ``shift3`` (A's missing family), the held-out set ``heldout``
    prompts per family of ``shift3`` and ``shift6``. Returns the teaching record."""
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model, char_tokenizer

    seen: set[str] = set()
    train = _lookup_rows(("shift3",), pool, seed, "train", seen)
    held = _lookup_rows(("shift3", "shift6"), 2 * heldout, seed + 1, "heldout", seen)
    for path, rows in ((tb.train_file, train), (tb.eval_file, held)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    crng = random.Random(seed + 4)
    corpus = [
        PLAIN_TEMPLATE.replace("{prompt}", _lookup_problem(f, crng)[0]) + lookup_response(crng.randrange(10))
        for _ in range(300)
        for f in LOOKUP_FAMILIES
    ]
    build_tiny_model(
        tb.model_a,
        "llama",
        char_tokenizer(chat_template=None),
        hidden=64,
        layers=2,
        heads=4,
        max_positions=256,
        seed=seed,
    )
    build_tiny_model(
        tb.model_b,
        "gpt2",
        bpe_tokenizer(corpus, vocab_size=320),
        hidden=64,
        layers=2,
        heads=4,
        max_positions=256,
        seed=seed + 1,
    )
    info = {}
    for name, path, n in (("A", tb.model_a, steps[0]), ("B", tb.model_b, steps[1])):
        if progress:
            print(f"testbed: teaching lookup model {name} ({n} steps, about {n // 15} s on 2 cores)...", flush=True)
        info[name] = _lookup_teach(path, name, n, seed + 5 + (name == "B"))
    _sharpen(tb.model_a, LOOKUP_SHARPEN_A)
    info["A"]["logit_scale"] = LOOKUP_SHARPEN_A
    return info


def lookup_right_digit_probability(model_dir: str | Path, problems) -> list[float]:
    """Each problem's probability, under the lookup model in ``model_dir``, of the right digit right
    after ``\\boxed{`` (where its responses put the answer): how often a sample would be right."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in problems:
        ids = tok(PLAIN_TEMPLATE.replace("{prompt}", p.problem) + "\\boxed{", add_special_tokens=False).input_ids
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        out.append(float(probs[tok(p.answer, add_special_tokens=False).input_ids[0]]))
    return out


def _sharpen(model_dir: Path, scale: float) -> None:
    """Scale a Llama-like model's logits by ``scale`` (its final norm's weight; the head is tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        net.model.norm.weight.mul_(scale)
    net.save_pretrained(model_dir)


@dataclass
class Testbed:
    """A built testbed: two model directories and two JSONL files under ``root``.

    ``shipped``: a build that ships inside the package (``graft_rl/testbed_files/<pair>``, see
    :func:`shipped_testbed`); configs then name it ``zoo:testbed-a`` / ``testbed_train`` (natural
    pair) or ``zoo:transfer-a`` / ``transfer_train`` (transfer pair) instead of paths, so they work
    on any machine.
    """

    root: Path
    shipped: bool = False
    pair: str = "natural"

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

    @property
    def families(self) -> tuple[str, ...] | None:
        """The prompt families of the pair (None: the natural pair's uniform mixture of every kind)."""
        return PAIRS[self.pair].families

    @property
    def heldout_per_family(self) -> int | None:
        """Held-out problems per family (pairs with families)."""
        return PAIRS[self.pair].heldout if self.families else None

    def refs(self) -> dict[str, str]:
        """How a config names this build's models and data."""
        if self.shipped:
            m, d = ("testbed", "testbed") if self.pair == "natural" else (self.pair, self.pair)
            return {"A": f"zoo:{m}-a", "B": f"zoo:{m}-b", "train": f"{d}_train", "heldout": f"{d}_heldout"}
        return {
            "A": str(self.model_a),
            "B": str(self.model_b),
            "train": str(self.train_file),
            "heldout": str(self.eval_file),
        }

    def policy_dicts(self, lr: float = 1e-4) -> list[dict]:
        common = {"prompt_format": "plain", "plain_template": PLAIN_TEMPLATE, "prompt_suffix": None, "lr": lr}
        refs = self.refs()
        return [{"name": "A", "model": refs["A"], **common}, {"name": "B", "model": refs["B"], **common}]

    def train_config(self, run_dir: str = "runs/demo", method: str | None = None) -> dict:
        """The embedded default of ``graft train``: the default method (GRAFT) on this pair, a few minutes on 2
        cores; ``method``: another method's name."""
        if self.pair == "lookup":  # one-token answers after a sentence, a one-family pool, unbalanced exchange
            raise ValueError(
                "the lookup pair's runs are configs/lookup/graft.yaml and grpo.yaml, not an arithmetic default"
            )
        return {
            "run_dir": run_dir,
            "seed": 0,
            "steps": 60,
            "prompt_batch": 32,
            "minibatch": 8,
            "n": 8,
            "max_new_tokens": 40,
            "checkpoint_every": 30,
            "data": {"train": self.refs()["train"], "reward": "gsm8k"},
            "validation": {
                "data": self.refs()["heldout"],
                "every": 30,
                "samples": 4,
                "limit": 256,
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": 40,
            },
            "method": {"name": method} if method else {},
            "policies": self.policy_dicts(),
        }


#: Warm-up steps of the natural pair (kept for callers of ensure_testbed; see PAIRS).
WARMUP_STEPS = PAIRS["natural"].warmup_steps

#: Bumped whenever the build procedure changes what it produces for the same arguments, so a
#: cached build from an older procedure is rebuilt instead of silently reused.
BUILD_VERSION = 2


def _prompt_sets(spec: PairSpec, seed: int, pool: int, heldout: int) -> tuple[list[dict], list[dict]]:
    """The prompt pool and the held-out set (disjoint expressions)."""
    if spec.families is None:  # the natural pair: uniform over every kind (its shipped build's procedure)
        train = make_split(pool, seed, prefix="train")
        seen = {t["problem"] for t in train}
        held = [r for r in make_split(pool + heldout * 2, seed + 1, prefix="heldout") if r["problem"] not in seen]
        return train, held[:heldout]
    fams = spec.families
    train = make_split(pool, seed, {f: 1.0 for f in fams}, prefix="train")
    seen = {r["problem"] for r in train}
    per = []
    for j, fam in enumerate(fams):  # held-out: `heldout` problems of each family, none in the pool
        in_pool = sum(1 for r in train if r["subject"] == fam)
        rows = [
            r
            for r in make_split(heldout + in_pool, seed + 1 + 100 * j, {fam: 1.0}, prefix="h")
            if r["problem"] not in seen
        ]
        if len(rows) < heldout:
            raise ValueError(
                f"testbed family {fam!r} has fewer than {heldout} held-out problems outside a pool of {pool}"
            )
        per.append(rows[:heldout])
    held = [dict(r, id=f"heldout-{i}") for i, r in enumerate(r for group in zip(*per, strict=False) for r in group)]
    return train, held


def ensure_testbed(
    root: str | Path,
    seed: int = 0,
    warmup_steps: tuple[int, int] | None = None,
    pool: int | None = None,
    heldout: int | None = None,
    progress: bool = True,
    pair: str = "natural",
) -> Testbed:
    """Build (once) the pair (:data:`PAIRS`) and its data under ``root``; later calls return the cached build.

    ``warmup_steps``, ``pool``, ``heldout`` default to the pair's spec (``heldout`` is per family
    for a pair with families).
    """
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model, char_tokenizer

    if pair not in PAIRS:
        raise ValueError(f"unknown testbed pair {pair!r}; available: {', '.join(PAIRS)}")
    spec = PAIRS[pair]
    warmup_steps = tuple(warmup_steps or spec.warmup_steps)
    pool, heldout = pool or spec.pool, heldout or spec.heldout
    tb = Testbed(Path(root), pair=pair)
    done = tb.root / "testbed.json"
    build = {
        "version": BUILD_VERSION,
        "seed": seed,
        "warmup_steps": list(warmup_steps),
        "pool": pool,
        "heldout": heldout,
    }
    if pair != "natural":
        build["pair"] = pair
    if done.is_file():
        try:
            cached = json.loads(done.read_text()).get("build")
        except (json.JSONDecodeError, AttributeError):
            cached = None
        if cached == build:
            return tb
        if progress:
            print(
                f"testbed: the cached build in {tb.root} was made with other settings ({cached} != {build}); rebuilding",
                flush=True,
            )
        done.unlink()  # only this build's own files are replaced below
    tb.root.mkdir(parents=True, exist_ok=True)
    if pair == "lookup":
        info = build_lookup_pair(tb, seed, warmup_steps, pool, heldout, progress)
        done.write_text(json.dumps({"build": build, "warmup": info, "heldout_rows": 2 * heldout}, indent=1))
        return tb
    train, held = _prompt_sets(spec, seed, pool, heldout)
    for path, rows in ((tb.train_file, train), (tb.eval_file, held)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    warm_a = make_split(20000, seed + 2, spec.mixture_a, prefix="wa", unique=False)
    warm_b = make_split(20000, seed + 3, spec.mixture_b, prefix="wb", unique=False)
    train_exprs = {r["problem"] for r in train} | {r["problem"] for r in held}
    warm_a = [r for r in warm_a if r["problem"] not in train_exprs]
    warm_b = [r for r in warm_b if r["problem"] not in train_exprs]
    bpe = bpe_tokenizer(_corpus_text(make_split(3000, seed + 4, prefix="c", unique=False)), vocab_size=320)
    build_tiny_model(tb.model_a, "llama", char_tokenizer(chat_template=None), hidden=128, layers=2, heads=4, seed=seed)
    build_tiny_model(tb.model_b, "gpt2", bpe, hidden=128, layers=2, heads=4, seed=seed + 1)
    info = {}
    for name, path, rows, s, steps in (
        ("A", tb.model_a, warm_a, seed + 5, warmup_steps[0]),
        ("B", tb.model_b, warm_b, seed + 6, warmup_steps[1]),
    ):
        if progress:
            print(f"testbed: warming up model {name} ({steps} steps, about {steps // 30} s on 2 cores)...", flush=True)
        info[name] = warm_up(path, rows, steps, s)
    done.write_text(json.dumps({"build": build, "warmup": info, "heldout_rows": len(held)}, indent=1))
    return tb


def shipped_root(pair: str) -> Path:
    """Where the shipped build of ``pair`` lives inside the package."""
    if pair not in PAIRS:
        raise ValueError(f"unknown testbed pair {pair!r}; available: {', '.join(PAIRS)}")
    from graft_rl.data import TESTBED_FILES  # one folder per pair (scripts/build_testbed.py)

    return TESTBED_FILES / pair


def shipped_testbed(pair: str = "natural") -> Testbed:
    """A testbed pair that ships with graft-rl (built once by ``scripts/build_testbed.py``, sha256
    and held-out accuracy recorded in ``testbed_files/<pair>/testbed.json``): the same weights on every
    machine, nothing to build."""
    tb = Testbed(shipped_root(pair), shipped=True, pair=pair)
    if not (tb.root / "testbed.json").is_file():
        raise FileNotFoundError(
            f"{tb.root}: the shipped testbed is missing; reinstall graft-rl or run "
            f"scripts/build_testbed.py --pair {pair}"
        )
    return tb
