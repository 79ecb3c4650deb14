"""The datasets that ship with graft-rl (``files/PROVENANCE.md``): the paper's training set and five
benchmarks (Section 5.1), GSM8K, and the CPU testbed pairs' prompt pools; their names, files and
verifiers."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN", "BUILTIN_LEFT_OUT", "TESTBED_DATA", "TESTBED_FILES", "BENCHMARKS", "files_dir"]


_FILES = Path(__file__).resolve().parent / "files"


#: name -> (file, verifier kind)
BUILTIN: dict[str, tuple[str, str]] = {
    "math_train": ("math_train.jsonl.gz", "math"),  # gzip: 7.1 MB of JSONL
    "math500": ("math500.jsonl", "math"),
    "aime24": ("aime24.jsonl", "math"),
    "aime25": ("aime25.jsonl", "math"),
    "amc23": ("amc23.jsonl", "math"),
    "minerva": ("minerva_math.jsonl", "math"),
    "gsm8k_train": ("gsm8k_train.jsonl", "gsm8k"),
    "gsm8k_test": ("gsm8k_test.jsonl", "gsm8k"),
}


#: The CPU testbed pairs' shipped prompt pools and held-out sets (built by scripts/build_testbed.py,
#: procedural arithmetic; see graft_rl.testbed): name -> (file under graft_rl/testbed_files, verifier)
TESTBED_DATA: dict[str, tuple[str, str]] = {
    "testbed_train": ("natural/train.jsonl", "gsm8k"),
    "testbed_heldout": ("natural/heldout.jsonl", "gsm8k"),
    "transfer_train": ("transfer/train.jsonl", "gsm8k"),  # the capability-transfer pair's two families
    "transfer_heldout": ("transfer/heldout.jsonl", "gsm8k"),
    "lookup_train": ("lookup/train.jsonl", "gsm8k"),  # the mechanism check's pair: A's missing family only
    "lookup_heldout": ("lookup/heldout.jsonl", "gsm8k"),
}


TESTBED_FILES = Path(__file__).resolve().parent.parent / "testbed_files"


#: The paper's five evaluation benchmarks (Section 5.1), in its table order.
BENCHMARKS = ("math500", "aime24", "aime25", "amc23", "minerva")


#: Built-in problems left out at load, with the reason (files/PROVENANCE.md, "Known issues"): their
#: reference answer is empty in the source (the original MATH solutions say ``\boxed{}``), so no
#: response could ever score on them.
BUILTIN_LEFT_OUT = {"math_train": ("train/number_theory/7115.json", "train/number_theory/7117.json")}


def files_dir() -> Path:
    """Folder of the shipped JSONL files and their provenance (``PROVENANCE.md``)."""
    return _FILES
