"""Rewards as plugins: a function by import path, by file path, registered by name, or a Python
callable; held to its contract in the verifier pool (one line per way to break it)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from graft_rl.data import Problem
from graft_rl.rewards import RewardError, VerifierPool, register_reward, resolve_reward

USER_MODULE = textwrap.dedent(
    """
    import os, time

    def exact(responses, problems):
        return [float(r.strip() == p["answer"]) for r, p in zip(responses, problems)]

    def by_column(responses, problems):  # reads a column the core schema does not have
        return [float(p["weight"]) * len(r) for r, p in zip(responses, problems)]

    def two(responses, problems):
        return [1.0, 0.0]

    def text(responses, problems):
        return ["yes"]

    def nan(responses, problems):
        return [float("nan")]

    def boom(responses, problems):
        raise ZeroDivisionError("my reward divided by zero")

    def sometimes(responses, problems):
        if responses[0] == "bad":
            raise KeyError("bad")
        return [1.0]

    def sleepy(responses, problems):
        time.sleep(60)
        return [1.0]

    def dies(responses, problems):
        os._exit(3)
    """
)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """A module on sys.path only after the process's verifier workers may have started."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_task_reward.py").write_text(USER_MODULE)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("my_task_reward", None)


@pytest.fixture(scope="module")
def pool():
    p = VerifierPool(num_workers=2, preload=())
    yield p
    p.close()


ROWS = [Problem("a", "1+1", "2", extra={"weight": 2}).row(), Problem("b", "2+2", "4", extra={"weight": 3}).row()]


def test_a_function_by_import_path_scores_in_the_pool_with_every_column(user_module, pool):
    r = resolve_reward("my_task_reward:exact")
    assert not r.builtin and r.root == str(user_module)
    scores, st = r.score(["2", " 5 "], ROWS, pool=pool)
    assert scores == [1.0, 0.0] and st.total == 2 and st.ok == 2
    assert resolve_reward("my_task_reward:by_column").score(["abc", "x"], ROWS, pool=pool)[0] == [6.0, 3.0]


def test_a_function_by_file_path(user_module, pool):
    r = resolve_reward(f"{user_module / 'my_task_reward.py'}:exact")
    assert r.score(["2", "4"], ROWS, pool=pool)[0] == [1.0, 1.0]


def test_a_callable_from_a_script_or_notebook_travels_by_value(pool):
    offset = 0.5

    def shaped(responses, problems):  # a closure, defined where no import path names it
        return [offset + len(r) / 10 for r in responses]

    r = resolve_reward(shaped, threshold=0.7)
    assert r.payload is not None and r.name.endswith("shaped")
    scores, _ = r.score(["ab", "abcd"], ROWS, pool=pool)
    assert scores == pytest.approx([0.7, 0.9]) and r.successes(scores) == [True, True]
    assert r.successes([0.69, 0.7]) == [False, True]


def test_an_importable_callable_is_kept_as_its_path(user_module):
    import my_task_reward

    r = resolve_reward(my_task_reward.exact)
    assert r.payload is None and r.target == "my_task_reward:exact"


def test_a_registered_name(user_module, pool):
    import my_task_reward

    register_reward("exact_match_test")(my_task_reward.exact)
    r = resolve_reward("exact_match_test")
    assert r.name == "exact_match_test" and r.score(["2"], ROWS[:1], pool=pool)[0] == [1.0]
    with pytest.raises(RewardError, match="'math' is a built-in reward"):
        register_reward("math")(my_task_reward.exact)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("two", r"reward my_task_reward:two on problem 'a': reward contract: returned 2 scores for 1 response$"),
        ("text", r"reward contract: returned str 'yes', not a number"),
        ("nan", r"reward contract: returned nan, not a finite number"),
        ("boom", r"failed on every response of the batch \(first, problem 'a': raised ZeroDivisionError: my reward"),
        ("sleepy", r"failed on every response .* did not return within 1s \(data.verify_timeout\)"),
        ("dies", r"failed on every response .* killed its worker"),
    ],
)
def test_a_broken_reward_is_one_line_naming_it(user_module, pool, fn, message):
    r = resolve_reward(f"my_task_reward:{fn}")
    with pytest.raises(RewardError, match=message) as err:
        r.score(["2", "4"], ROWS, timeout=1.0, pool=pool)
    assert "\n" not in str(err.value)


def test_a_reward_that_fails_on_some_responses_scores_them_zero_and_counts_them(user_module, pool):
    scores, st = resolve_reward("my_task_reward:sometimes").score(["ok", "bad"], ROWS, pool=pool)
    assert scores == [1.0, 0.0] and st.error == 1 and "KeyError" in st.errors[0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_x:f", r"data.reward 'no_such_module_x:f': cannot load it \(ModuleNotFoundError"),
        ("my_task_reward:nope", r"cannot load it \(AttributeError"),
        ("exactt", r"data.reward 'exactt': not a reward name \(math, gsm8k, gym"),
        ("/nowhere/r.py:f", r"/nowhere/r.py: no such file"),
        ("python:shaped", r"was scored by a Python function given to Trainer\(reward=...\); give it again"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_one_line(user_module, spec, message):
    with pytest.raises(RewardError, match=message):
        resolve_reward(spec)


def test_builtins_keep_their_names_and_scores():
    r = resolve_reward("gsm8k")
    assert r.builtin and r.score(["\\boxed{2}", "#### 5"], ROWS)[0] == [1.0, 0.0]


def test_the_old_key_data_verifier_still_reads_as_data_reward():
    from graft_rl.engine.config import ConfigError, load_config

    base = {"policies": [{"name": "A", "model": "x"}], "method": {"name": "grpo"}}
    assert load_config({**base, "data": {"verifier": "gsm8k"}}).data.reward == "gsm8k"
    assert load_config({**base, "data": {"verifier": "math", "reward": "math"}}).data.reward == "math"
    with pytest.raises(
        ConfigError, match=r"data.verifier \('math'\) is the old name of data.reward \('gsm8k'\); give one"
    ):
        load_config({**base, "data": {"verifier": "math", "reward": "gsm8k"}})
    with pytest.raises(ConfigError, match=r"data.success_threshold: expected a number"):
        load_config({**base, "data": {"success_threshold": "high"}})
