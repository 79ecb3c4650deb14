"""This example's reward. graft-rl calls ``reward(responses, problems)`` in its verifier pool, one
response per call, under ``data.verify_timeout``; each problem is a dict of every column of its row
(this table's own ``question``, ``target``, ``task``, and graft-rl's ``problem``/``answer``).

The answer is the last ``\\boxed{...}``. An exact answer scores 1. The ``upper`` game gives partial
credit, 0.5, for the right word in the wrong case, so GRPO's advantages see progress; with
``data.success_threshold: 1.0`` only an exact answer is a success for GRAFT's selection.
"""

import re

BOX = re.compile(r"\\boxed\{([^{}]*)\}")


def reward(responses: list[str], problems: list[dict]) -> list[float]:
    scores = []
    for response, problem in zip(responses, problems, strict=True):
        found = BOX.findall(response)
        got, want = (found[-1].strip() if found else None), problem["target"]
        if got is None:
            scores.append(0.0)
        elif problem["task"] == "first":
            scores.append(1.0 if got.lower() == want.lower() else 0.0)
        elif got == want:
            scores.append(1.0)
        else:
            scores.append(0.5 if got.upper() == want else 0.0)
    return scores
