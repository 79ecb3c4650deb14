"""Build this example's data files (shipped: rerun only to change them).

Two word games, written as a user's own table would be -- columns ``question``, ``target`` and
``task``, not graft-rl's ``problem``/``answer`` (the config's ``data.columns`` maps them):

- ``first``: the first letter of a word;
- ``upper``: the word in capital letters.

The words are reasoning-gym's (its ``spell_backward`` vocabulary, 4-8 letters). Each word appears in
one family only; words are split 3:1 into training and held-out prompts (seed 0).

    python examples/word_games/make_data.py
"""

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import reasoning_gym

QUESTIONS = {
    "first": ('What is the first letter of the word "{w}"?', lambda w: w[0]),
    "upper": ('Write the word "{w}" in capital letters.', lambda w: w.upper()),
}


def words(n: int) -> list[str]:
    ds = reasoning_gym.create_dataset("spell_backward", size=4 * n, seed=0, min_word_len=4, max_word_len=8)
    found = {e["question"].rsplit(":", 1)[1].strip() for e in ds}
    return sorted(w for w in found if w.isalpha() and w.islower())


def main() -> None:
    here = Path(__file__).resolve().parent / "data"
    here.mkdir(exist_ok=True)
    pool = words(200)
    random.Random(0).shuffle(pool)
    rows = []
    for i, w in enumerate(pool[:320]):
        task = list(QUESTIONS)[i % 2]
        question, answer = QUESTIONS[task]
        rows.append({"question": question.format(w=w), "target": answer(w), "task": task})
    cut = len(rows) * 3 // 4
    pq.write_table(pa.Table.from_pylist(rows[:cut]), here / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[cut:]), here / "heldout.parquet")
    print(f"{cut} training and {len(rows) - cut} held-out prompts in {here}")


if __name__ == "__main__":
    main()
