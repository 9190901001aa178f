"""Reasoning fidelity: did the model close its thinking, and how many tokens went where."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSplit:
    """``reasoning`` tokens up to and including the think-end token, ``answer`` after it."""

    think_end_present: bool
    reasoning_tokens: int
    answer_tokens: int


def split_reasoning(output_ids: Sequence[int], think_end_id: int) -> ReasoningSplit:
    """Split at the first think-end token; without one, everything is reasoning."""
    try:
        end = list(output_ids).index(think_end_id)
    except ValueError:
        return ReasoningSplit(False, len(output_ids), 0)
    return ReasoningSplit(True, end + 1, len(output_ids) - end - 1)
