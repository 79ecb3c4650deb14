"""A large table starts as fast as a small one (issue 40, item 4): the prompt-length checks tokenise
only prompts whose size could reach a limit and give what tokenising every prompt gives; the token
bound they rest on holds for every text; a step's rows are kept, not the table's."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import pyarrow as pa
import pytest
from hypothesis import given, settings

from graft_rl.data import Problem
from graft_rl.data.table import from_arrow
from graft_rl.engine.handles import LocalHandle
from graft_rl.engine.prompts import PromptRows, check_prompts
from graft_rl.engine.worker import PolicyWorker, prompt_budget
from graft_rl.methods import MethodConfig
from graft_rl.policy import Policy, PolicyConfig
from graft_rl.policy.tokens import PromptTooLongError


@pytest.fixture(scope="module")
def policies(tiny_pair):
    """The tiny pair with short contexts: (ChatML, byte tokens) and (plain, BPE)."""
    return {
        "A": Policy(PolicyConfig("A", str(tiny_pair[0]), max_prompt_tokens=400)),
        "B": Policy(PolicyConfig("B", str(tiny_pair[1]), max_prompt_tokens=400)),
    }


def _table(n: int, long_every: int = 0, long_len: int = 150) -> list:
    rows = [
        {
            "id": f"q{i}",
            "problem": ("x " * long_len if long_every and i % long_every == 0 else f"{i}+{i}=?"),
            "answer": "1",
        }
        for i in range(n)
    ]
    return from_arrow(pa.Table.from_pylist(rows), "t")


class _Calls:
    """A driver's view of the workers: counts the prompts each call carries (what Ray would ship)."""

    def __init__(self, policies, monkeypatch):
        self.workers = {n: PolicyWorker(p, MethodConfig(), 2) for n, p in policies.items()}
        self.shipped = 0
        self.tokenised = 0
        real = Policy.prompt_token_ids

        def counted(policy, problem, prompt_id=""):
            self.tokenised += 1
            return real(policy, problem, prompt_id)

        monkeypatch.setattr(Policy, "prompt_token_ids", counted)

    def handles(self) -> dict:
        """Each worker behind a handle that counts the prompts a ``prompt_budget`` call carries."""
        calls = self

        class Counting(LocalHandle):
            def prompt_budget(self, problems, max_new_tokens):
                calls.shipped += len(problems)
                return super().prompt_budget(problems, max_new_tokens)

        return {n: Counting(w) for n, w in self.workers.items()}


@pytest.mark.parametrize("max_new", [8, 300, 480])
def test_the_checks_give_what_tokenising_every_prompt_gives(policies, monkeypatch, max_new):
    table = _table(400, long_every=37)
    val = [Problem("v0", "5+5=?", "10"), Problem("v1", "y " * 100, "1")]
    calls = _Calls(policies, monkeypatch)
    got = check_prompts(calls.handles(), table, [val], max_new)
    every = list(table) + val
    for name, p in policies.items():
        prompt_budget(p, every, 1)  # fits
        assert got[name] == prompt_budget(p, list(table), max_new)
    if max_new == 8:  # only prompts that could reach a limit went to the workers (at 480 every one can)
        assert calls.shipped < len(every)


def test_a_large_table_tokenises_only_its_long_prompts(policies, monkeypatch):
    table = _table(20_000, long_every=5_000)
    calls = _Calls(policies, monkeypatch)
    got = check_prompts(calls.handles(), table, [], 8)
    assert got == {"A": (8, None), "B": (8, None)}
    assert calls.tokenised <= 2 * 2 * 4  # per policy: the 4 long prompts, for the fit and the budget checks


def test_a_prompt_too_long_is_still_one_line_naming_it(policies, monkeypatch):
    table = _table(5_000, long_every=4_999, long_len=300)  # rows 0 and 4998 are 600 bytes: over 400 tokens
    calls = _Calls(policies, monkeypatch)
    with pytest.raises(PromptTooLongError, match=r"prompt 'q0' has \d+ tokens, over max_prompt_tokens=400"):
        check_prompts(calls.handles(), table, [], 8)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=120))
def test_the_token_bound_holds_for_any_text(policies, text):
    from graft_rl.policy.tokens import prompt_bound

    for p in policies.values():
        b = prompt_bound(p)
        assert b["factor"] == 1  # byte-level and BPE tokenizers without a normaliser
        n = len(p.prompt_token_ids(text))
        assert n <= b["factor"] * (b["overhead"] + len(text.encode())) + b["slack"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["zoo:smollm2-135m-instruct", "zoo:gemma3-270m"])
def test_the_token_bound_holds_for_the_real_small_lms_tokenizers(model):
    pytest.importorskip("gguf", reason="the real small LMs need the gguf extra")
    from graft_rl.policy.loading import load_tokenizer
    from graft_rl.policy.tokens import token_factor
    from graft_rl.policy.zoo import resolve

    path = Path(resolve(model))
    tok = load_tokenizer(path.parent, path.name)  # as a policy loads it (converted once, then cached)
    k = token_factor(tok)
    assert k in (1, 3)
    texts = [
        "What is 2+3?",
        "  spaces  and\ttabs\n",
        "é à ü ß 中文 العربية 🙂" * 5,
        "\\boxed{\\frac{1}{2}}" * 20,
        "ﷺ" * 10,
    ]
    for text in texts:
        assert len(tok(text).input_ids) <= k * len(text.encode()) + 8


def test_a_step_keeps_its_rows_not_the_table():
    table = _table(1_000)
    rows = PromptRows(table)
    drawn = rows.draw([5, 7], step=1)
    assert drawn == [("q5", "5+5=?"), ("q7", "7+7=?")] and rows["q5"]["problem"] == "5+5=?" and rows.index("q7") == 7
    rows.draw([1], step=2)
    rows.draw([2], step=3)
    rows.draw([3], step=4)  # step 1's rows are two steps behind the newest: forgotten
    assert "q5" not in rows and {"q1", "q2", "q3"} <= set(rows)
