"""Nothing wrong is silent (issue 24, first items): GSM8K references are held to the response's
one-number rule, answers no response could match are refused at load, limits of 0 are errors, and
method values out of range or read by no part of the chosen method are refused, each in one line."""

from __future__ import annotations

import json

import pytest

from graft_rl.data import DatasetError, check_answers, load_dataset
from graft_rl.engine.config import ConfigError, load_config
from graft_rl.rewards import verify_gsm8k


@pytest.mark.parametrize(
    "reference, first_number",
    [("1/2", "1"), (r"\frac{1}{2}", "1"), ("1e+20", "1"), ("12-5", "12"), ("3 or 4", "3"), ("2^{10}", "2")],
)
def test_gsm8k_reference_is_not_read_by_its_first_number(reference, first_number):
    assert verify_gsm8k([rf"\boxed{{{first_number}}}"], [reference]) == [0.0]


def test_gsm8k_fraction_reference_matches_its_value_only():
    assert verify_gsm8k([r"\boxed{0.5}", r"\boxed{1}"], ["1/2", "1/2"]) == [1.0, 0.0]


@pytest.mark.parametrize("answer", ["abc", "", "NaN", "12-5", "3 or 4", "1e+20"])
def test_answers_a_gsm8k_response_could_never_match_are_refused_at_load(tmp_path, answer):
    from graft_rl.data import Problem

    with pytest.raises(DatasetError, match=r"train\.jsonl: problem 'q1' has answer .* not one number"):
        check_answers([Problem("q0", "1+1", "2"), Problem("q1", "x", answer)], "gsm8k", "train.jsonl")


@pytest.mark.parametrize("answer", ["", "  ", "nan"])
def test_empty_math_answers_are_refused(answer):
    from graft_rl.data import Problem

    with pytest.raises(DatasetError, match="could never match"):
        check_answers([Problem("q0", "x", answer)], "math", "d.jsonl")


def test_the_training_data_is_checked_before_anything_loads(tmp_path):
    from graft_rl.engine.trainer import Trainer

    data = tmp_path / "gsm8k_bad.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "problem": "p", "answer": "abc" if i == 3 else "4"}) + "\n" for i in range(8)
        )
    )
    cfg = load_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": str(data), "reward": "gsm8k"},
            "prompt_batch": 4,
            "method": {"name": "grpo"},
            "policies": [{"name": "A", "model": str(tmp_path / "none")}],
        }
    )
    with pytest.raises(DatasetError, match="problem 'q3' has answer 'abc'"):
        Trainer(cfg, show_progress=False)
    assert not (tmp_path / "run").exists()  # nothing left behind


def test_builtin_math_train_leaves_out_its_two_empty_references():
    rows = load_dataset("math_train")
    assert len(rows) == 7498 and all(r.answer.strip() for r in rows)
    check_answers(rows, "math", "math_train")


@pytest.mark.parametrize("limit", [0, -3])
def test_a_limit_below_one_is_an_error_not_one_problem(limit):
    with pytest.raises(DatasetError, match=f"limit must be >= 1.*got {limit}"):
        load_dataset("gsm8k_test", limit)
    for key in ("data.limit", "validation.limit"):
        with pytest.raises(ConfigError, match=rf"{key} must be >= 1"):
            load_config({"policies": [{"name": "A", "model": "x"}], "method": {"name": "grpo"}}, [f"{key}={limit}"])


@pytest.mark.parametrize("flag", ["samples", "runs", "limit", "max_new_tokens"])
def test_graft_eval_refuses_zero_counts(flag, capsys):
    from graft_rl.commands.cli import main

    assert main(["eval", "zoo:testbed-a", "--benchmarks", "testbed_heldout", f"--{flag.replace('_', '-')}", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--{flag.replace('_', '-')} must be >= 1, got 0" in err


@pytest.mark.parametrize(
    "override, match",
    [
        ("method.eps_low=-1", r"method.eps_low must be in \[0, 1\), got -1"),
        ("method.eps_high=nan", r"method.eps_high must be in"),
        ("method.adv_eps=0", r"method.adv_eps must be in \(0"),
        ("method.delta=-0.1", r"method.delta must be in"),
        ("method.hacpo_capability_window=0", r"hacpo_capability_window must be >= 1"),
    ],
)
def test_method_values_out_of_range_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(
            {"policies": [{"name": "A", "model": "x"}, {"name": "B", "model": "y"}], "method": {"name": "hacpo"}},
            [override],
        )


@pytest.mark.parametrize(
    "method, key, value, users",
    [
        ("grpo", "delta", 0.5, "graft, sgt, luffy, hacpo, sapo, prp, xgrpo, ftis"),
        ("sgt", "luffy_gamma", 0.3, "luffy"),
        ("graft", "sgt_coef", 0.5, "sgt"),
        ("graft", "dynamic_sampling", True, "grpo, dr_grpo"),
    ],
)
def test_a_method_key_the_method_does_not_read_is_refused(method, key, value, users, tmp_path):
    data = {
        "policies": [{"name": "A", "model": "x"}, {"name": "B", "model": "y"}],
        "method": {"name": method, key: value},
    }
    with pytest.raises(ConfigError, match=rf"method.{key} is not used by method '{method}' \(it is used by: {users}\)"):
        load_config(data)
    # a run directory's own config.yaml (written before the check) still loads for resume / eval; the
    # key the method never read is dropped (as it was ignored)
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    loaded = load_config(path, saved=True).method
    if key == "delta":  # a common key: kept as written
        assert loaded.delta == value
    else:  # another method's own key: not this method's, so not kept
        assert key not in loaded.to_flat()


def test_every_shipped_config_passes_the_method_key_check():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(root.rglob("*.yaml")):
        load_config(path)


@pytest.mark.parametrize(
    "override, match",
    [
        ("policies.0.lr=-1e-3", "lr must be a finite number > 0"),
        ("policies.0.lr=nan", "lr must be a finite number > 0"),
        ("policies.0.betas=[0.9, 1.5]", r"betas must be two numbers in \[0, 1\)"),
        ("policies.0.max_grad_norm=0", "max_grad_norm must be > 0"),
    ],
)
def test_bad_optimiser_values_are_one_line_config_errors(override, match):
    with pytest.raises(ConfigError, match=rf"policy 'A': {match}"):
        load_config({"policies": [{"name": "A", "model": "x"}], "method": {"name": "grpo"}}, [override])


def test_a_prompt_longer_than_a_models_context_is_one_line_before_training(tmp_path, tiny_pair, capsys):
    """Issue 24: a 1,500-character problem under max_prompt_tokens but over a 512-position model's
    context stops `graft train` before any step (it was an IndexError mid-run), naming the prompt."""
    import yaml

    from graft_rl.commands.cli import main

    data = tmp_path / "long.jsonl"
    rows = [{"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(8)]
    rows[5]["problem"] = "x" * 1500 + " 1+1=?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "data": {"train": str(data)},
        "prompt_batch": 4,
        "n": 2,
        "steps": 1,
        "method": {"name": "graft"},
        "policies": [{"name": "A", "model": str(tiny_pair[0])}, {"name": "B", "model": str(tiny_pair[1])}],
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompt 'q5' has" in err[0] and "over the model's 512-token context" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_response_never_runs_past_a_learned_position_models_context(tmp_path, capsys):
    """Issue 24: prompt + max_new_tokens over a GPT-2's 64 positions (each alone fits) trained into an
    IndexError mid-generation; now the policy samples what its context leaves, and `graft train` says so."""
    import yaml

    from graft_rl.commands.cli import main
    from graft_rl.policy.tiny import bpe_tokenizer, build_tiny_model

    model = build_tiny_model(tmp_path / "gpt2_64", "gpt2", bpe_tokenizer(), max_positions=64)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "data": {"train": str(data)},
        "prompt_batch": 2,
        "n": 2,
        "steps": 1,
        "max_new_tokens": 60,
        "method": {"name": "grpo"},
        "policies": [{"name": "B", "model": str(model)}],
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "B has a 64-token context: max_new_tokens 60 ->" in out
    budget = int(out.split("max_new_tokens 60 -> ")[1].split()[0])
    assert 0 < budget < 60

    # and a direct call with a longer budget is capped by the same rule, the rows ending at the context
    from graft_rl.policy import Policy, PolicyConfig, SamplingParams

    pol = Policy(PolicyConfig(name="B", model=str(model)))
    groups = pol.generate([("q0", "0+0=?")], SamplingParams(n=2, max_new_tokens=500))
    prompt = len(pol.prompt_token_ids("0+0=?"))
    assert all(prompt + len(t) <= 64 for t in groups[0].token_ids)
