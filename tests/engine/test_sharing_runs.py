"""The methods published after the paper in a run (tiny models, fake rewards): SAPO's own prompt
streams and re-encoded external text, F-TIS's kept token ids and its one-vocabulary refusal, and
every new preset training and writing its exchange records."""

from __future__ import annotations

import json

import pytest

from graft_rl.engine.store import RecordStore
from graft_rl.errors import ConfigError


def _trainer(make_cfg, method: dict, run: str, **kw):
    from graft_rl.engine.trainer import Trainer

    return Trainer(make_cfg(method, steps=kw.pop("steps", 2), run=run, **kw), show_progress=False)


def test_own_prompt_streams_differ_per_policy_and_shared_ones_do_not(make_cfg, fake_rewards):
    tr = _trainer(make_cfg, {"name": "sapo", "sapo_external": 2}, "own", prompt_batch=4)
    try:
        assert tr.cfg.rollout.prompts == "own"  # auto, resolved for an unpaired exchange
        a, b = tr.rollouts.prompts_for_step(1, "A"), tr.rollouts.prompts_for_step(1, "B")
        assert a != b and a == tr.rollouts.prompts_for_step(1, "A")  # each its own stream, reproducibly
        epoch = {p for s in (1, 2) for p in tr.rollouts.prompts_for_step(s, "A")}
        assert len(epoch) == 8  # a stream is a shuffle of the whole set per epoch
    finally:
        tr.close()
    tr = _trainer(make_cfg, {"name": "graft"}, "shared", prompt_batch=4)
    try:
        assert tr.rollouts.prompts_for_step(1, "A") == tr.rollouts.prompts_for_step(1, "B")
    finally:
        tr.close()


def test_sapo_external_text_is_re_encoded_with_the_receivers_tokenizer(make_cfg, fake_rewards):
    tr = _trainer(make_cfg, {"name": "sapo", "sapo_external": 4}, "sapo", prompt_batch=4)
    try:
        groups, lines = tr.rollouts.verify(1, tr.rollouts.generate(1, tr.policies))
        batch = tr.exchange(1, groups, lines)["A"]
        ext = [i for i, r in enumerate(batch.rows) if r.is_peer]
        assert ext, "B had informative groups to share"
        worker = tr.workers["A"].worker
        tb = worker._encode(batch)
        pol = worker.policy
        for i in ext:
            r = batch.rows[i]
            want = pol.encode_texts([r.prompt], [r.text], [r.finished], None).response_ids[0]
            assert tb.response_ids[i] == want  # the receiver's tokens of the text ...
            assert tb.response_ids[i] != r.token_ids  # ... not the source's (another tokenizer)
        assert {r.prompt_id for r in batch.rows if r.is_peer} <= {g.prompt_id for g in groups["B"]}
    finally:
        tr.close()


def test_ftis_keeps_a_peers_sampled_token_ids_and_log_probs(make_cfg, tiny_pair, fake_rewards):
    same = [
        {"name": "A", "model": str(tiny_pair[0]), "lr": 1e-3},
        {"name": "B", "model": str(tiny_pair[0]), "lr": 1e-3},
    ]
    tr = _trainer(make_cfg, {"name": "ftis"}, "ftis", policies=same, prompt_batch=4)
    try:
        groups, lines = tr.rollouts.verify(1, tr.rollouts.generate(1, tr.policies))
        batch = tr.exchange(1, groups, lines)["A"]
        tb = tr.workers["A"].worker._encode(batch, 8)
        peer = [i for i, r in enumerate(batch.rows) if r.is_peer]
        assert peer
        for i in peer:
            r = batch.rows[i]
            assert tb.response_ids[i] == r.token_ids  # not re-tokenised
            assert (
                r.gen_logprobs
                == groups["B"][[g.prompt_id for g in groups["B"]].index(r.prompt_id)].gen_logprobs[r.index]
            )
    finally:
        tr.close()


def test_ftis_on_a_pair_without_one_vocabulary_is_one_line(make_cfg, fake_rewards):
    with pytest.raises(ConfigError) as exc:
        _trainer(make_cfg, {"name": "ftis"}, "ftis_pair")
    msg = str(exc.value)
    assert "\n" not in msg and "one shared vocabulary" in msg and "'A' and 'B'" in msg


@pytest.mark.parametrize(
    "method",
    [{"name": "sapo", "sapo_external": 2}, {"name": "prp"}, {"name": "xgrpo"}, {"name": "ftis"}],
    ids=lambda m: m["name"],
)
def test_each_new_method_trains_and_writes_its_exchange_records(make_cfg, tiny_pair, fake_rewards, method):
    policies = None
    if method["name"] == "ftis":  # one vocabulary: two copies of the Llama-like model
        policies = [{"name": n, "model": str(tiny_pair[0]), "lr": 1e-3} for n in ("A", "B")]
    tr = _trainer(make_cfg, method, method["name"], policies=policies, prompt_batch=4)
    try:
        tr.run()
    finally:
        tr.close()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(ln["loss"] is not None for ln in lines)
    ex = RecordStore(tr.run_dir).read_exchange()
    assert ex, "the exchange records what moved"
    want = "reward" if method["name"] == "xgrpo" else "response"
    assert {r["moved"] for r in ex} == {want}
    if method["name"] == "ftis":
        assert all("ftis_peer_responses" in ln for ln in lines)
