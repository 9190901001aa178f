"""Job states and the transitions between them (DESIGN §4)."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED_BUDGET = "skipped_budget"


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.SKIPPED_BUDGET}),
    JobState.RUNNING: frozenset({JobState.DONE, JobState.QUEUED, JobState.FAILED}),
    JobState.SKIPPED_BUDGET: frozenset({JobState.QUEUED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
}

ACTIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})


def can_transition(source: JobState, target: JobState) -> bool:
    """Whether the state machine allows ``source -> target``."""
    return target in TRANSITIONS[source]
