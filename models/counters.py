"""The per-dataset job counters: what a statement that moves jobs adds to its dataset row.

Every transaction that changes a job's state updates the job's dataset row anyway (the
ledger), so the counters ride on that same UPDATE: no extra statement and no extra lock on
the hot row. `eaglegen audit` checks them against the jobs.
"""

from __future__ import annotations

from typing import Any

from models.schema import Dataset
from models.states import COUNTER_COLUMN, JobState


def moved(source: JobState | None, target: JobState | None, n: int = 1) -> dict[str, Any]:
    """Column values of an UPDATE of datasets for ``n`` jobs moving ``source`` → ``target``
    (None: the jobs are new, or gone)."""
    values: dict[str, Any] = {}
    if source is not None:
        values[COUNTER_COLUMN[source]] = getattr(Dataset, COUNTER_COLUMN[source]) - n
    if target is not None:
        values[COUNTER_COLUMN[target]] = getattr(Dataset, COUNTER_COLUMN[target]) + n
    return values


def moved_sql(source: JobState, target: JobState) -> str:
    """``moved`` as SQL for a SET clause, for the statements written in SQL (models.attempt)."""
    a, b = COUNTER_COLUMN[source], COUNTER_COLUMN[target]
    return f"{a} = {a} - 1, {b} = {b} + 1"


def recorded_sql(prompt: str, completion: str) -> str:
    """SQL for a SET clause counting one generation recorded: the done jobs' tokens (from
    the named parameters) and times."""
    return (
        f"done_prompt_tokens = done_prompt_tokens + %({prompt})s, "
        f"done_completion_tokens = done_completion_tokens + %({completion})s, "
        "first_done_at = coalesce(first_done_at, now()), last_done_at = now()"
    )
