"""The budget ledger's arithmetic and token amounts (parse, format). Pure, no I/O."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
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


class ReservePolicy(StrEnum):
    """What a job of a dataset reserves at its claim (docs/design.md §4, "Budget ledger")."""

    # The observed completion lengths' OBSERVED_QUANTILE once OBSERVED_MIN_SAMPLES are
    # recorded, the worst case before: near its budget a dataset keeps running about
    # max_new_tokens / quantile times more jobs at once, for a larger overshoot bound.
    OBSERVED = "observed"
    # Always max_new_tokens: the final overshoot stays below one job's worst case.
    WORST_CASE = "worst_case"


# "observed" reserves this quantile of a dataset's completion lengths: a job then outgrows
# its reservation about once in a hundred. A high quantile, not the mean: what the jobs in
# flight at the end write beyond their reservations is what the budget may overshoot by.
OBSERVED_QUANTILE = 0.99
# Lengths needed before the quantile replaces the worst case: with fewer, the first answers
# to finish are the short ones (the long ones are still running), and the top percent of the
# sample is one or two answers.
OBSERVED_MIN_SAMPLES = 200
# The record refreshes the estimate once every this many done jobs of the dataset: the
# claim only reads a column, and the lengths are read this rarely.
OBSERVED_REFRESH_EVERY = 100
# The estimate is taken over the dataset's latest this many completions.
OBSERVED_SAMPLE = 2_000


def worst_case(prompt_tokens: int, max_new_tokens: int, basis: BudgetBasis) -> int:
    """What one job may consume at most."""
    return max_new_tokens + (prompt_tokens if basis is BudgetBasis.TOTAL else 0)


def reservation(
    prompt_tokens: int, max_new_tokens: int, basis: BudgetBasis, observed: int | None
) -> int:
    """What one job reserves at its claim: its worst case, with the completion part lowered
    to ``observed`` (the dataset's estimate, None: none) when that is smaller. At least one
    token, so that a running job always holds something (the ledger's "nothing held" rule
    reads the reserved sum)."""
    completion = max_new_tokens if observed is None else min(max_new_tokens, observed)
    return max(1, completion) + (prompt_tokens if basis is BudgetBasis.TOTAL else 0)


def observed_completion(completions: Sequence[int], max_new_tokens: int) -> int | None:
    """The completion tokens a job reserves under ``observed``: the OBSERVED_QUANTILE of
    ``completions`` (nearest rank: a length that was seen), never above ``max_new_tokens``;
    None (reserve the worst case) with fewer than OBSERVED_MIN_SAMPLES lengths."""
    if len(completions) < OBSERVED_MIN_SAMPLES:
        return None
    ranked = sorted(completions)
    rank = math.ceil(OBSERVED_QUANTILE * len(ranked))
    return max(1, min(max_new_tokens, ranked[rank - 1]))


def estimate_due(done: int) -> bool:
    """Whether the record that makes ``done`` done jobs of a dataset refreshes its observed
    estimate: at OBSERVED_MIN_SAMPLES, then every OBSERVED_REFRESH_EVERY."""
    return (
        done >= OBSERVED_MIN_SAMPLES and (done - OBSERVED_MIN_SAMPLES) % OBSERVED_REFRESH_EVERY == 0
    )


def overshoot_bound(max_new_tokens: int, reserved_completions: Sequence[int]) -> int:
    """The most a budget's settled tokens can end above it (docs/design.md §4), given the
    completion tokens reserved by each job in flight after the dataset's last claim: what
    those jobs may produce beyond their reservations, or, when that claim ran alone, one
    job's worst case less one token, whichever is larger. On the total basis the one-job
    term also counts that job's prompt (the prompt part of a reservation is exact)."""
    beyond = sum(max_new_tokens - min(max_new_tokens, r) for r in reserved_completions)
    return max(beyond, max_new_tokens - 1)


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
