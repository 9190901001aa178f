"""Budget amounts, reservations and the observed estimate's arithmetic."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from models.budgets import BudgetChange
from models.ledger import (
    OBSERVED_MIN_SAMPLES,
    OBSERVED_REFRESH_EVERY,
    BudgetBasis,
    estimate_due,
    format_tokens,
    observed_completion,
    overshoot_bound,
    parse_tokens,
    reservation,
    settled,
    worst_case,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10M", 10_000_000),
        ("500k", 500_000),
        ("1.5M", 1_500_000),
        ("1200000", 1_200_000),
        ("2G", 2_000_000_000),
        (" 7 k ", 7_000),
        (42, 42),
        ("unlimited", None),
        (None, None),
    ],
)
def test_parse_tokens(text: str | int | None, value: int | None) -> None:
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["ten", "10X", "-5", "1.0001k", ""])
def test_parse_tokens_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="token"):
        parse_tokens(text)


def test_worst_case_depends_on_basis() -> None:
    assert worst_case(100, 4096, BudgetBasis.COMPLETION) == 4096
    assert worst_case(100, 4096, BudgetBasis.TOTAL) == 4196


def test_format_tokens() -> None:
    assert [format_tokens(v) for v in (None, 999, 512_000, 10_000_000)] == [
        "unlimited",
        "999",
        "512.0k",
        "10.0M",
    ]


def test_settled_amount_follows_the_basis() -> None:
    assert settled(100, 50, BudgetBasis.COMPLETION) == 50
    assert settled(100, 50, BudgetBasis.TOTAL) == 150


def test_a_reservation_is_the_worst_case_until_there_is_an_estimate() -> None:
    assert reservation(100, 4096, BudgetBasis.COMPLETION, None) == 4096
    assert reservation(100, 4096, BudgetBasis.TOTAL, None) == 4196


def test_a_reservation_lowers_the_completion_part_to_the_estimate_only() -> None:
    assert reservation(100, 4096, BudgetBasis.COMPLETION, 1500) == 1500
    assert reservation(100, 4096, BudgetBasis.TOTAL, 1500) == 1600  # the prompt is exact
    assert reservation(100, 4096, BudgetBasis.COMPLETION, 9000) == 4096  # never above
    assert reservation(100, 4096, BudgetBasis.COMPLETION, 0) == 1  # a running job holds some


def test_no_estimate_from_too_few_lengths() -> None:
    assert observed_completion([10] * (OBSERVED_MIN_SAMPLES - 1), 4096) is None
    assert observed_completion([10] * OBSERVED_MIN_SAMPLES, 4096) == 10


def test_the_estimate_is_the_99th_percentile_by_nearest_rank() -> None:
    lengths = list(range(1000, 0, -1))  # 1..1000, in any order
    assert observed_completion(lengths, 4096) == 990
    assert observed_completion([*lengths, 5000], 4096) == 991  # 1001 lengths: rank 991


def test_the_estimate_is_never_above_max_new_tokens() -> None:
    # More than one answer in a hundred cut at max_new_tokens: the estimate is the worst case.
    lengths = [50] * 970 + [512] * 30
    assert observed_completion(lengths, 512) == 512
    assert observed_completion([9999] * 300, 512) == 512


def test_the_estimate_is_refreshed_at_the_minimum_then_every_few_done_jobs() -> None:
    due = [n for n in range(1, 3 * OBSERVED_MIN_SAMPLES) if estimate_due(n)]
    assert due[0] == OBSERVED_MIN_SAMPLES
    assert all(b - a == OBSERVED_REFRESH_EVERY for a, b in pairwise(due))


def test_the_overshoot_bound() -> None:
    # Worst-case reservations: below one job's worst case, as before.
    assert overshoot_bound(100, [100, 100, 100]) == 99
    # Three jobs reserving 40 of 100 may each write 60 more than they hold.
    assert overshoot_bound(100, [40, 40, 40]) == 180
    # One job in flight: the one-job term is larger.
    assert overshoot_bound(100, [40]) == 99


def test_a_lowered_budget_warns_of_the_running_jobs_worst_case_not_what_they_hold() -> None:
    # Reserving from observed lengths, 3 running jobs hold 300 tokens but may write 3 x 1,000.
    change = BudgetChange(
        budget_tokens=500, used_tokens=400, running_jobs=3, reserved_tokens=300,
        worst_case_tokens=3_000, requeued=[],
    )  # fmt: skip
    assert change.may_exceed_by == 2_900
    assert replace(change, running_jobs=0, reserved_tokens=0).may_exceed_by == 0
    assert replace(change, budget_tokens=None).may_exceed_by == 0
    assert replace(change, budget_tokens=10_000).may_exceed_by == 0
