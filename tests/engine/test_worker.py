"""The policy worker (graft_rl.engine.worker): a receiver's batch in its own tokens."""

from __future__ import annotations


def test_the_trainer_counts_cut_peer_responses(make_cfg, fake_rewards):
    """``peer_cut`` in metrics: GRAFT's peer groups re-tokenised over the receiver's budget."""
    import json

    from graft_rl.engine.trainer import Trainer

    tr = Trainer(make_cfg({"name": "graft", "gate": False}, steps=1, run="cut", max_new_tokens=6), show_progress=False)
    tr.run()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= ln["peer_cut"] <= ln["exchanged_in"] * tr.cfg.n for ln in lines)
    # A (one token per character) receives B's BPE responses of 6 tokens: most are longer here
    assert sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A") > 0
    # and a cut response is left out of the loss (the exchange records say so)
    from graft_rl.engine.store import RecordStore

    rows = RecordStore(tr.run_dir).read_exchange("A")
    assert sum(not r["included"] for r in rows) == sum(ln["peer_cut"] for ln in lines if ln["policy"] == "A")
