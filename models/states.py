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


# Each state's counter column on the dataset row (models.counters). Here, beside the states,
# so that `eaglegen status` (models.status) reads the same map without importing SQLAlchemy.
COUNTER_COLUMN: dict[JobState, str] = {
    JobState.QUEUED: "jobs_queued",
    JobState.RUNNING: "jobs_running",
    JobState.DONE: "jobs_done",
    JobState.FAILED: "jobs_failed",
    JobState.SKIPPED_BUDGET: "jobs_skipped",
}
