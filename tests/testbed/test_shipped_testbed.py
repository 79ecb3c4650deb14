"""The testbed pairs ship in the package (issue 13): the files are the recorded build (sha256) and
the models reproduce their recorded greedy held-out accuracy on the fixed sample."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from graft_rl.testbed import PAIRS, shipped_root, shipped_testbed

ROOT = Path(__file__).resolve().parents[2]
META = {pair: json.loads((shipped_root(pair) / "testbed.json").read_text()) for pair in PAIRS}


@pytest.mark.parametrize("pair,rel", [(p, r) for p in PAIRS for r in sorted(META[p]["files"])])
def test_shipped_files_match_their_recorded_sha256(pair, rel):
    assert hashlib.sha256((shipped_root(pair) / rel).read_bytes()).hexdigest() == META[pair]["files"][rel]


@pytest.mark.parametrize("pair", PAIRS)
def test_nothing_unrecorded_ships(pair):
    root = shipped_root(pair)
    shipped = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {"testbed.json"}
    assert shipped == set(META[pair]["files"])


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("which", ["A", "B"])
def test_shipped_models_reproduce_their_recorded_heldout_accuracy(pair, which):
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_testbed import greedy_heldout_accuracy

    meta = META[pair]["heldout_greedy"]
    tb = shipped_testbed(pair)
    acc = greedy_heldout_accuracy(tb, which, meta["problems"])
    assert acc == pytest.approx(meta["accuracy"][which], abs=1.5 / 64)  # at most one problem apart
    if tb.families:
        by = greedy_heldout_accuracy(tb, which, meta["problems"], by_family=True)
        assert by == pytest.approx(meta["by_family"][which], abs=1.5 / 32)


@pytest.mark.parametrize("pair", PAIRS)
def test_shipped_data_is_disjoint_and_named_in_configs(pair):
    from graft_rl.data import load_dataset

    tb = shipped_testbed(pair)
    refs = tb.refs()
    train, held = load_dataset(refs["train"]), load_dataset(refs["heldout"])
    assert len(train) == META[pair]["build"]["pool"] and len(held) == META[pair]["heldout_rows"]
    assert not {p.problem for p in train} & {p.problem for p in held}
    prefix = "testbed" if pair == "natural" else pair
    assert refs == {
        "A": f"zoo:{prefix}-a",
        "B": f"zoo:{prefix}-b",
        "train": f"{prefix}_train",
        "heldout": f"{prefix}_heldout",
    }


def test_transfer_pair_lacks_one_family_each():
    """The constructed pair: each model greedy-solves its own family and not the other's, and the
    held-out set alternates the families (so validation.limit keeps them balanced)."""
    from graft_rl.data import load_dataset

    by = META["transfer"]["heldout_greedy"]["by_family"]
    assert by["A"]["add3_hi"] > 0.5 and by["A"]["muladd_hi"] < 0.05
    assert by["B"]["muladd_hi"] > 0.2 and by["B"]["add3_hi"] < 0.05
    held = load_dataset("transfer_heldout")
    assert [p.subject for p in held[:4]] == ["muladd_hi", "add3_hi"] * 2
    assert {p.subject: sum(q.subject == p.subject for q in held) for p in held} == {"muladd_hi": 256, "add3_hi": 256}
