"""Budget amounts and worst-case arithmetic."""

from __future__ import annotations

import pytest

from models.budget import (
    BudgetBasis,
    Reservation,
    decide_reservation,
    format_tokens,
    parse_tokens,
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


@pytest.mark.parametrize(
    ("budget", "used", "reserved", "need", "decision"),
    [
        (None, 10**12, 10**9, 4096, Reservation.RESERVE),  # unlimited
        (10_000, 0, 0, 4096, Reservation.RESERVE),
        (10_000, 4000, 4096, 1904, Reservation.RESERVE),  # exactly fits
        (10_000, 4000, 4096, 1905, Reservation.DEFER),  # a running job may free budget
        (10_000, 9000, 0, 4096, Reservation.RESERVE),  # nothing held: last job may overshoot
        (10_000, 10_000, 0, 1, Reservation.SKIP),  # settled usage reached the budget
        (10_000, 12_000, 4096, 1, Reservation.SKIP),
    ],
)
def test_reservation_rule(
    budget: int | None, used: int, reserved: int, need: int, decision: Reservation
) -> None:
    assert decide_reservation(budget, used, reserved, need) is decision


def test_overshoot_is_below_one_reservation() -> None:
    # Simulate a serial ledger: every job reserves its worst case and settles for less.
    import random

    rng = random.Random(3)
    for _ in range(200):
        budget, need = rng.randint(1, 50_000), rng.randint(1, 5_000)
        used = 0
        while decide_reservation(budget, used, 0, need) is Reservation.RESERVE:
            used += rng.randint(0, need)  # a real completion never exceeds max_new_tokens
        assert used < budget + need


def test_settled_amount_follows_the_basis() -> None:
    assert settled(100, 50, BudgetBasis.COMPLETION) == 50
    assert settled(100, 50, BudgetBasis.TOTAL) == 150
