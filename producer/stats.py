"""Per-dataset counters and prompt-length percentiles. Pure, no I/O."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from models.ledger import BudgetBasis


def percentiles(values: Sequence[int], points: Sequence[int] = (50, 90, 99)) -> dict[str, int]:
    """Nearest-rank percentiles plus max (all 0 for no values)."""
    if not values:
        return {**{f"p{p}": 0 for p in points}, "max": 0}
    ordered = sorted(values)
    out = {f"p{p}": ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)] for p in points}
    out["max"] = ordered[-1]
    return out


@dataclass
class DatasetStats:
    """What enqueueing (or a dry run of) one dataset found."""

    dataset: str
    max_new_tokens: int
    budget_tokens: int | None
    budget_basis: BudgetBasis
    rows: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected_by_reason: Counter[str] = field(default_factory=Counter)
    prompt_lengths: array[int] = field(default_factory=lambda: array("I"))
    accepted_prompt_tokens: int = 0
    # What of a multi-turn row is answered (datasets.turns), and with "all": the rows that
    # are conversations (new ones, and the answer points of each row read).
    turns: str = "last"
    conversations: int = 0
    conversation_points: array[int] = field(default_factory=lambda: array("I"))
    # Turns the new conversations will have at most (their answer points; a conversation
    # may end sooner): each a job once the one before it is done.
    conversation_turns: int = 0
    # Generations asked of each prompt and the variants' names (core.samples): ``accepted``
    # counts every sample's job.
    samples: int = 1
    variants: tuple[str, ...] = ()

    @property
    def rejected(self) -> int:
        """Rows that did not become jobs because they are bad."""
        return sum(self.rejected_by_reason.values())

    def worst_case_tokens(self) -> int:
        """Tokens the accepted jobs may consume at most, on the budget's basis."""
        jobs = self.accepted - self.conversations + self.conversation_turns
        generated = self.max_new_tokens * jobs
        if self.budget_basis is BudgetBasis.TOTAL:
            return generated + self.accepted_prompt_tokens
        return generated

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` shape of one dataset."""
        return {
            "rows": self.rows,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "duplicates": self.duplicates,
            "rejected_by_reason": dict(sorted(self.rejected_by_reason.items())),
            "prompt_tokens": percentiles(self.prompt_lengths),
            "worst_case_tokens": self.worst_case_tokens(),
            "budget_tokens": self.budget_tokens,
            "budget_basis": self.budget_basis.value,
            "turns": self.turns,
            "samples": self.samples,
            "variants": list(self.variants),
            "conversations": {
                "new": self.conversations,
                "turns_to_come": self.conversation_turns,
                "turns_per_conversation": percentiles(self.conversation_points),
            },
        }


def totals(stats: Sequence[DatasetStats]) -> dict[str, int]:
    """Sums over datasets of the row counters."""
    return {
        "rows": sum(s.rows for s in stats),
        "accepted": sum(s.accepted for s in stats),
        "rejected": sum(s.rejected for s in stats),
        "duplicates": sum(s.duplicates for s in stats),
    }
