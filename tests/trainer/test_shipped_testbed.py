"""The testbed pair ships in the package (issue 13): the files are the recorded build (sha256) and
the models reproduce their recorded greedy held-out accuracy on the fixed sample."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from graft_rl.testbed import SHIPPED_ROOT, shipped_testbed

ROOT = Path(__file__).resolve().parents[2]
META = json.loads((SHIPPED_ROOT / "testbed.json").read_text())


@pytest.mark.parametrize("rel", sorted(META["files"]))
def test_shipped_files_match_their_recorded_sha256(rel):
    assert hashlib.sha256((SHIPPED_ROOT / rel).read_bytes()).hexdigest() == META["files"][rel]


def test_nothing_unrecorded_ships():
    shipped = {str(p.relative_to(SHIPPED_ROOT)) for p in SHIPPED_ROOT.rglob("*") if p.is_file()} - {"testbed.json"}
    assert shipped == set(META["files"])


@pytest.mark.parametrize("which", ["A", "B"])
def test_shipped_models_reproduce_their_recorded_heldout_accuracy(which):
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_testbed import greedy_heldout_accuracy

    acc = greedy_heldout_accuracy(shipped_testbed(), which, META["heldout_greedy"]["problems"])
    assert acc == pytest.approx(META["heldout_greedy"]["accuracy"][which], abs=1.5 / 64)  # at most one problem apart


def test_shipped_data_is_disjoint_and_named_in_configs():
    from graft_rl.data import load_dataset

    train, held = load_dataset("testbed_train"), load_dataset("testbed_heldout")
    assert len(train) == META["build"]["pool"] and len(held) == META["heldout_rows"]
    assert not {p.problem for p in train} & {p.problem for p in held}
    assert shipped_testbed().refs() == {"A": "zoo:testbed-a", "B": "zoo:testbed-b", "train": "testbed_train",
                                        "heldout": "testbed_heldout"}
