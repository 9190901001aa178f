"""The reasoning/answer split of a generation."""

from __future__ import annotations

from worker.reasoning import split_reasoning

END = 10


def test_split_at_the_first_think_end() -> None:
    split = split_reasoning([20, 21, END, 30, 31, 4], END)
    assert (split.think_end_present, split.reasoning_tokens, split.answer_tokens) == (True, 3, 3)


def test_no_think_end_means_all_reasoning() -> None:
    split = split_reasoning([20, 21, 22], END)
    assert (split.think_end_present, split.reasoning_tokens, split.answer_tokens) == (False, 3, 0)


def test_empty_output() -> None:
    split = split_reasoning([], END)
    assert (split.think_end_present, split.reasoning_tokens, split.answer_tokens) == (False, 0, 0)
