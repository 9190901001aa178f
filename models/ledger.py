"""The budget ledger's arithmetic and token amounts (parse, format). Pure, no I/O."""

from __future__ import annotations

import re
from enum import StrEnum

_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGbB]?)\s*$")
_SCALE = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}
UNLIMITED = ("unlimited", "none", "inf")


class BudgetBasis(StrEnum):
    """What a budget counts: generated tokens only, or prompt plus generated."""

    COMPLETION = "completion"
    TOTAL = "total"


def parse_tokens(text: str | int | None) -> int | None:
    """``10M`` → 10_000_000, ``500k`` → 500_000, ``unlimited``/None → None."""
    if text is None:
        return None
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a token budget cannot be negative: {text}")
        return text
    if text.strip().lower() in UNLIMITED:
        return None
    match = _AMOUNT.match(text)
    if match is None:
        raise ValueError(f"not a token amount: {text!r} (use e.g. 10M, 500k, 1200000, unlimited)")
    number, suffix = match.groups()
    value = float(number) * _SCALE[suffix.lower()]
    if value != int(value):
        raise ValueError(f"not a whole number of tokens: {text!r}")
    return int(value)


def worst_case(prompt_tokens: int, max_new_tokens: int, basis: BudgetBasis) -> int:
    """What one job may consume at most: its reservation under the ledger."""
    return max_new_tokens + (prompt_tokens if basis is BudgetBasis.TOTAL else 0)


def format_tokens(value: int | None) -> str:
    """A short human form: 10.0M, 512k, unlimited."""
    if value is None:
        return "unlimited"
    for scale, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return str(value)


def settled(prompt_tokens: int, completion_tokens: int, basis: BudgetBasis) -> int:
    """What a recorded generation costs the budget."""
    return completion_tokens + (prompt_tokens if basis is BudgetBasis.TOTAL else 0)
