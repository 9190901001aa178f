"""Budget amounts and worst-case arithmetic."""

from __future__ import annotations

import pytest

from models.ledger import (
    BudgetBasis,
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


def test_settled_amount_follows_the_basis() -> None:
    assert settled(100, 50, BudgetBasis.COMPLETION) == 50
    assert settled(100, 50, BudgetBasis.TOTAL) == 150
