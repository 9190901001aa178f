"""Queries of the job life cycle: release, fail, leases (the claim and the record are in
models.attempt)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select, update

from core.text import visible
from models import attempt
from models.counters import moved
from models.records import Claim, GenerationRecord
from models.schema import Dataset, FailedAttempt, Job
from models.states import JobState

RUNNING = JobState.RUNNING.value
# The class of a failed attempt a lapsed lease stands for (the worker died or froze).
LEASE_EXPIRED = "lease_expired"
# Ids per lookup statement (a reconciler may publish a whole run's jobs after Redis lost them).
_LOOKUP_BATCH = 10_000


class JobQueries:
    """Mixin of the Repository: every state change of a job, each in one transaction."""

    engine: Engine

    def claim(self, job_id: int, worker: str, lease_seconds: int) -> Claim:
        """Win a queued job for ``worker`` and hold its reservation in the budget ledger
        (models.attempt)."""
        return attempt.claim(self.engine, job_id, worker, lease_seconds)

    def record(self, job_id: int, worker: str, gen: GenerationRecord) -> bool:
        """Store the generation, settle the ledger, mark done: atomically; False if not ours
        (models.attempt)."""
        return attempt.record(self.engine, job_id, worker, gen)

    def release(
        self,
        job_id: int,
        worker: str,
        error: str,
        *,
        refund: bool = False,
        server: str | None = None,
        kind: str | None = None,
        retry_in_s: float = 0.0,
    ) -> bool:
        """Give a running job back to the queue, for the feeder to publish again in its
        order after ``retry_in_s``; ``refund`` when it was not its fault. With ``kind``, the
        attempt is counted as failed (on ``server``) for `status`."""
        return self._end_attempt(
            job_id,
            worker,
            JobState.QUEUED,
            error,
            refund=refund,
            server=server,
            kind=kind,
            retry_in_s=retry_in_s,
        )

    def fail(
        self,
        job_id: int,
        worker: str,
        error: str,
        *,
        server: str | None = None,
        kind: str | None = None,
    ) -> bool:
        """End a running job as failed with the reason, releasing its reservation."""
        return self._end_attempt(job_id, worker, JobState.FAILED, error, server=server, kind=kind)

    def _end_attempt(
        self,
        job_id: int,
        worker: str,
        target: JobState,
        error: str,
        *,
        refund: bool = False,
        server: str | None,
        kind: str | None,
        retry_in_s: float = 0.0,
    ) -> bool:
        with self.engine.begin() as conn:
            job = _lock_running(conn, job_id, worker)
            if job is None:
                return False
            if kind is not None:
                _count_failure(conn, [job.dataset_id], server, kind)
            _settle(conn, job, target, used=0, error=error, refund=refund, retry_in_s=retry_in_s)
        return True

    def extend_leases(self, job_ids: list[int], worker: str, lease_seconds: int) -> int:
        """Push the leases of this worker's running jobs forward; how many were still ours."""
        if not job_ids:
            return 0
        stmt = (
            update(Job)
            .where(Job.id.in_(job_ids), Job.worker == worker, Job.state == RUNNING)
            .values(lease_until=func.now() + timedelta(seconds=lease_seconds))
        )
        with self.engine.begin() as conn:
            return int(conn.execute(stmt).rowcount)

    def expire_leases(self, max_attempts: int) -> list[int]:
        """Re-queue running jobs whose lease ran out (their worker died); the re-queued ids."""
        requeued = []
        with self.engine.begin() as conn:
            rows = conn.execute(
                select(Job.id, Job.dataset_id, Job.reserved_tokens, Job.attempts)
                .where(Job.state == RUNNING, Job.lease_until < func.now())
                .with_for_update(skip_locked=True)
            ).all()
            _count_failure(conn, [row.dataset_id for row in rows], None, LEASE_EXPIRED)
            for row in rows:
                target = JobState.QUEUED if row.attempts < max_attempts else JobState.FAILED
                error = f"lease expired (worker gone?) after attempt {row.attempts}"
                _settle(conn, row, target, used=0, error=error)
                if target is JobState.QUEUED:
                    requeued.append(int(row.id))
        return requeued


def _lock_running(conn: Connection, job_id: int, worker: str) -> Any:
    return conn.execute(
        select(Job.id, Job.dataset_id, Job.reserved_tokens, Job.attempts)
        .where(Job.id == job_id, Job.state == RUNNING, Job.worker == worker)
        .with_for_update()
    ).one_or_none()


def _settle(
    conn: Connection,
    job: Any,
    target: JobState,
    *,
    used: int,
    error: str | None,
    refund: bool = False,
    counted: dict[str, Any] | None = None,
    retry_in_s: float = 0.0,
) -> None:
    """Move a locked running job to ``target`` and return its reservation to the ledger;
    ``counted``: more dataset counters to move (a recorded generation's). A job back in
    `queued` has no message out: the feeder publishes it in its order after ``retry_in_s``."""
    values: dict[str, Any] = {
        "state": target.value,
        "reserved_tokens": 0,
        "lease_until": None,
        # A server's own words may be in it (an error body): stored without the control
        # characters that would rewrite the terminal of whoever reads it in `status`.
        "last_error": None if error is None else visible(error)[:4000],
        "updated_at": func.now(),
    }
    if target in (JobState.DONE, JobState.FAILED):
        values["finished_at"] = func.now()
    if target is JobState.QUEUED:
        values["published_at"] = None
        values["not_before"] = (
            func.now() + timedelta(seconds=retry_in_s) if retry_in_s > 0 else None
        )
    if refund:
        values["attempts"] = Job.attempts - 1
    conn.execute(update(Job).where(Job.id == job.id).values(**values))
    conn.execute(
        update(Dataset)
        .where(Dataset.id == job.dataset_id)
        .values(
            used_tokens=Dataset.used_tokens + used,
            reserved_tokens=Dataset.reserved_tokens - job.reserved_tokens,
            **moved(JobState.RUNNING, target),
            **(counted or {}),
        )
    )


def _count_failure(conn: Connection, dataset_ids: list[int], server: str | None, kind: str) -> None:
    """Note failed attempts for `status` (one row each; read by time range)."""
    if dataset_ids:
        conn.execute(
            insert(FailedAttempt),
            [{"dataset_id": d, "server": server, "kind": kind[:32]} for d in dataset_ids],
        )
