"""Jobs by state per dataset, as a table and as one JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from eaglegen.report.text import shown
from models.records import DatasetCounts
from models.states import JobState


def totals(counts: Sequence[DatasetCounts]) -> dict[str, int]:
    """Jobs per state over all datasets, plus ``total``."""
    out = {state.value: 0 for state in JobState}
    for dataset in counts:
        for state, n in dataset.states.items():
            out[state] += n
    out["total"] = sum(out.values())
    return out


def status_document(counts: Sequence[DatasetCounts]) -> dict[str, Any]:
    """The ``eaglegen status --json`` document."""
    return {
        "datasets": [
            {
                "run": c.run,
                "dataset": c.dataset,
                "jobs": {**c.states, "total": c.total},
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
            }
            for c in counts
        ],
        "jobs": totals(counts),
        "prompt_tokens": sum(c.prompt_tokens for c in counts),
        "completion_tokens": sum(c.completion_tokens for c in counts),
    }


def connections_warning(in_use: int, limit: int) -> str | None:
    """What to do when Postgres nears its connection limit (at 80% of it), else None."""
    if in_use < 0.8 * limit:
        return None
    return (
        f"Postgres has {in_use} of its {limit} connections in use: each worker process opens "
        "up to EAGLEGEN_DB_POOL_SIZE; lower it, raise max_connections, or put PgBouncer in "
        'front (README, "Many workers")'
    )


def status_table(counts: Sequence[DatasetCounts]) -> Table:
    """A rich table: one row per dataset, one column per state."""
    table = Table(title="eaglegen status")
    table.add_column("run")
    table.add_column("dataset")
    for state in JobState:
        table.add_column(state.value, justify="right")
    table.add_column("total", justify="right")
    table.add_column("completion tok", justify="right")
    for c in counts:
        table.add_row(
            shown(c.run),
            shown(c.dataset),
            *(f"{c.states[s.value]:,}" for s in JobState),
            f"{c.total:,}",
            f"{c.completion_tokens:,}",
        )
    return table
