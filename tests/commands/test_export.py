"""graft export: a LoRA policy merged into a plain transformers directory that scores as the policy does."""

from __future__ import annotations

import pytest
import torch

from graft_rl.commands.cli import main
from graft_rl.policy import Policy, PolicyConfig

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

TEXTS = ["3+4=7. \\boxed{7}", "no", "6*7=42 \\boxed{42}"]


def _trained_adapter(model: str, tmp_path):
    from graft_rl.algo import policy_loss

    pol = Policy(PolicyConfig("A", model, lr=5e-2, lora={"r": 4, "alpha": 8}))
    batch = pol.encode_texts(["Q"] * 3, TEXTS, [True] * 3)
    old, mask = pol.token_logprobs(batch)
    adv = torch.tensor([1.0, -1.0, 0.5])
    for _ in range(2):
        pol.update(batch, lambda lp, m, rows: (policy_loss(lp, old[rows, : lp.shape[1]], adv[rows], m)[0], {}))
    return pol, pol.save(tmp_path / "ckpt" / "A"), batch


@pytest.mark.parametrize("which", [0, 1], ids=["llama", "gpt2"])
def test_export_loads_in_plain_transformers_and_scores_as_the_adapter(which, tiny_pair, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    pol, ckpt, batch = _trained_adapter(str(tiny_pair[which]), tmp_path)
    assert main(["export", str(ckpt), "--merged", str(tmp_path / "out")]) == 0
    assert "A ->" in capsys.readouterr().out
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not any("lora" in n for n in plain.state_dict())
    lp, mask = pol.token_logprobs(batch)
    got, _ = pol.token_logprobs(batch, plain)
    assert torch.allclose(lp * mask, got * mask, atol=1e-5)
    base, _ = Policy(PolicyConfig("A", str(tiny_pair[which]))).token_logprobs(batch)
    assert not torch.allclose(base * mask, got * mask, atol=1e-4)  # the adapter's training is in it
    # the export is a policy graft eval can load as it is (its prompt format kept, no adapter)
    again = Policy(PolicyConfig("A", str(tmp_path / "out")))
    assert again.lora is None and torch.allclose(again.token_logprobs(batch)[0] * mask, lp * mask, atol=1e-5)


def test_export_never_overwrites(tiny_pair, tmp_path, capsys):
    _, ckpt, _ = _trained_adapter(str(tiny_pair[0]), tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["export", str(ckpt), "--merged", str(tmp_path / "out")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
