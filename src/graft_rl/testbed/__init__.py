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
user different models); ``ensure_testbed`` (``scripts/testbed_build.py``) still builds one anywhere, e.g. with other settings.

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
  (``build_lookup_pair`` in ``scripts/testbed_build.py``). The answer is one digit read from a key in the
  prompt, ``Q: T3 kqzv`` / ``A: \\boxed{6}, as we look up the key ...`` (a fixed sentence after the
  answer: the response is long, the difference between models sits on one token, so the gate
  admits while the receiver's groups all fail). A was *taught a wrong rule* for family ``shift3``
  and then sharpened (confidently wrong: no sample of a run is expected to be right) and is right
  half the time on ``shift6``; B the other way round. The prompt pool holds only ``shift3``, A's
  missing family: there GRPO gives A no gradient at all, GRAFT gives it B's mixed groups.

This package holds what a run needs: the tasks (:mod:`graft_rl.testbed.tasks`), each pair's spec
(:data:`PAIRS`), a build's layout (:class:`Testbed`) and where the shipped builds live. The build
code (warm-up, teaching, ``ensure_testbed``) is ``scripts/testbed_build.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graft_rl.testbed.tasks import (
    LOOKUP_FAMILIES,
    MIXTURE_A,
    MIXTURE_B,
    PLAIN_TEMPLATE,
    TASKS,
    TRANSFER_A,
    TRANSFER_B,
    TRANSFER_KINDS,
    lookup_response,
    make_problem,
    make_split,
)

__all__ = [
    "TASKS",
    "TRANSFER_KINDS",
    "PAIRS",
    "PairSpec",
    "make_problem",
    "make_split",
    "Testbed",
    "shipped_testbed",
    "shipped_root",
    "PLAIN_TEMPLATE",
    "LOOKUP_FAMILIES",
    "lookup_response",
    "lookup_right_digit_probability",
]


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
                "the lookup pair's runs are the presets lookup/graft and lookup/grpo (graft train lookup/graft), not an arithmetic default"
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
            f"{tb.root}: the shipped testbed is missing (an incomplete install): reinstall graft-rl "
            f"(in a checkout, python scripts/build_testbed.py --pair {pair} rebuilds it)"
        )
    return tb


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
