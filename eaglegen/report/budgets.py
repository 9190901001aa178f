"""Budgets per dataset as a table (`eaglegen budget show`)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from eaglegen.report.text import shown
from models.budgets import BudgetRow
from models.ledger import format_tokens


def budget_table(rows: Sequence[BudgetRow]) -> Table:
    """One row per dataset: its budget, what is used and reserved, and skipped jobs."""
    table = Table(title="budgets")
    for column in ("run", "dataset", "budget", "basis", "used", "reserved", "skipped jobs"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            shown(r.run),
            shown(r.dataset),
            format_tokens(r.budget_tokens),
            r.budget_basis,
            f"{r.used_tokens:,}",
            f"{r.reserved_tokens:,}",
            f"{r.skipped_jobs:,}",
        )
    return table
