"""A problem as a model is prompted with it: the paper's instruction (Appendix B) appended to the last
user turn."""

from __future__ import annotations

from graft_rl.data.problem import prompt_messages

__all__ = ["PROMPT_SUFFIX", "make_prompt", "prompt_chat"]


#: The paper's instruction appended to every problem (Appendix B).
PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def make_prompt(problem: str, suffix: str | None = PROMPT_SUFFIX) -> str:
    r"""The user message for a problem: the problem text, a newline, then the instruction.

    Examples:
        >>> make_prompt("What is 2+3?")
        "What is 2+3?\nLet's think step by step and output the final answer within \\boxed{}."
    """
    return problem if not suffix else f"{problem}\n{suffix}"


def prompt_chat(problem: str, suffix: str | None = PROMPT_SUFFIX) -> list[dict]:
    """The messages a model is prompted with: the problem as the user turn (or a chat prompt's own
    turns), with ``suffix`` appended to the last user turn (:func:`make_prompt`)."""
    chat = prompt_messages(problem) or [{"role": "user", "content": problem}]
    last_user = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=len(chat) - 1)
    return [{**m, "content": make_prompt(m["content"], suffix)} if i == last_user else m for i, m in enumerate(chat)]
