"""Building a CPU testbed pair (graft_rl.testbed): the supervised warm-up ("pretraining") of each
model on its own mixture, the lookup pair's teaching and sharpening, and :func:`ensure_testbed`, which
builds a pair and its data once under a directory. ``scripts/build_testbed.py`` runs it to make the
builds that ship in the package; the package itself only reads them.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from graft_rl.testbed import PAIRS, PairSpec, Testbed
from graft_rl.testbed.tasks import (
    LOOKUP_FAMILIES,
    LOOKUP_SHARPEN_A,
    LOOKUP_TEACHING,
    PLAIN_TEMPLATE,
    lookup_problem,
    lookup_response,
    lookup_rows,
    make_split,
)

__all__ = ["ensure_testbed", "warm_up", "build_lookup_pair", "BUILD_VERSION", "WARMUP_STEPS"]


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
                expr, k = lookup_problem(fam, rng)
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
    train = lookup_rows(("shift3",), pool, seed, "train", seen)
    held = lookup_rows(("shift3", "shift6"), 2 * heldout, seed + 1, "heldout", seen)
    for path, rows in ((tb.train_file, train), (tb.eval_file, held)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    crng = random.Random(seed + 4)
    corpus = [
        PLAIN_TEMPLATE.replace("{prompt}", lookup_problem(f, crng)[0]) + lookup_response(crng.randrange(10))
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


def _sharpen(model_dir: Path, scale: float) -> None:
    """Scale a Llama-like model's logits by ``scale`` (its final norm's weight; the head is tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        net.model.norm.weight.mul_(scale)
    net.save_pretrained(model_dir)


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
