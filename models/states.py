"""Job states (docs/design.md §4)."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Where a job is in its life.

    ``queued -> running -> done``; ``running -> queued`` (retryable error, lease expiry,
    budget deferral); ``running -> failed`` (permanent error or attempts exhausted);
    ``queued -> skipped_budget`` and back to ``queued`` when the budget is raised. Each
    transition is one conditional UPDATE in ``models.attempt``, ``models.jobs`` or
    ``models.budgets``.
    """

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED_BUDGET = "skipped_budget"
