"""Queries of the job life cycle: claim with budget reservation, record, release, leases."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, and_, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from models.counters import moved, recorded
from models.ledger import BudgetBasis, settled, worst_case
from models.records import Claim, ClaimedJob, GenerationRecord, RunModel
from models.schema import Dataset, FailedAttempt, Generation, Job, Run
from models.states import JobState

RUNNING = JobState.RUNNING.value
# The class of a failed attempt a lapsed lease stands for (the worker died or froze).
LEASE_EXPIRED = "lease_expired"
# Ids per lookup statement (a reconciler may publish a whole run's jobs after Redis lost them).
_LOOKUP_BATCH = 10_000


class _Rollback(Exception):
    """Raised inside a transaction to undo it and report an outcome."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class JobQueries:
    """Mixin of the Repository: every state change of a job, each in one transaction."""

    engine: Engine

    def claim(self, job_id: int, worker: str, lease_seconds: int) -> Claim:
        """Win a queued job for ``worker`` and reserve its worst case in the budget ledger."""
        try:
            with self.engine.begin() as conn:
                return _claim(conn, job_id, worker, lease_seconds)
        except _Rollback as rollback:
            return Claim(rollback.outcome)

    def record(self, job_id: int, worker: str, gen: GenerationRecord) -> bool:
        """Store the generation, settle the ledger, mark done: atomically; False if not ours."""
        try:
            with self.engine.begin() as conn:
                job = _lock_running(conn, job_id, worker)
                if job is None:
                    return False
                inserted = conn.scalar(
                    pg_insert(Generation)
                    .values(job_id=job_id, dataset_id=job.dataset_id, **generation_values(gen))
                    .on_conflict_do_nothing(index_elements=[Generation.job_id])
                    .returning(Generation.job_id)
                )
                if inserted is None:  # never while the claim holds; keep the first record
                    raise _Rollback("already_recorded")
                basis = conn.scalar(
                    select(Dataset.budget_basis).where(Dataset.id == job.dataset_id)
                )
                cost = settled(gen.prompt_tokens, gen.completion_tokens, BudgetBasis(str(basis)))
                done = recorded(gen.prompt_tokens, gen.completion_tokens)
                _settle(conn, job, JobState.DONE, used=cost, error=None, counted=done)
        except _Rollback:
            return False
        return True

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

    def run_model(self, job_id: int) -> RunModel | None:
        """The model of the job's run (None when the job is gone)."""
        stmt = (
            select(Run.name, Run.model_name, Run.tokenizer_path)
            .join(Dataset, Dataset.run_id == Run.id)
            .join(Job, Job.dataset_id == Dataset.id)
            .where(Job.id == job_id)
        )
        with self.engine.connect() as conn:
            row = conn.execute(stmt).one_or_none()
        return None if row is None else RunModel(row.name, row.model_name, row.tokenizer_path)

    def note_waiting(self, job_id: int, reason: str) -> None:
        """Say on a queued job why it waits (its state, attempts and age stay as they are)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(Job)
                .where(
                    Job.id == job_id,
                    Job.state == JobState.QUEUED.value,
                    Job.last_error.is_distinct_from(reason),
                )
                .values(last_error=reason)
            )


def _claim(conn: Connection, job_id: int, worker: str, lease_seconds: int) -> Claim:
    """Claim, then apply the ledger rule of DESIGN §4.

    A job runs when its worst case fits next to what is settled and held. When it does not
    fit but nothing is held, it runs anyway while settled usage is below the budget (else a
    job larger than the remainder would wait forever), so the final overshoot is below one
    job's reservation. Otherwise it is deferred while reservations are held, and skipped
    once settled usage reached the budget.
    """
    job = conn.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.QUEUED.value)
        .values(
            state=RUNNING,
            attempts=Job.attempts + 1,
            worker=worker,
            lease_until=func.now() + timedelta(seconds=lease_seconds),
            updated_at=func.now(),
        )
        .returning(
            Job.id,
            Job.dataset_id,
            Job.input_ids,
            Job.prompt_tokens,
            Job.attempts,
            Job.opens_reasoning,
        )
    ).one_or_none()
    if job is None:
        raise _Rollback("not_queued")
    ds = conn.execute(
        select(
            Dataset.sampling_params,
            Dataset.budget_basis,
            Dataset.name,
            Run.name.label("run"),
            Run.think_end_id,
            Run.vocab_size,
        )
        .join(Run, Run.id == Dataset.run_id)
        .where(Dataset.id == job.dataset_id)
    ).one()
    params = dict(ds.sampling_params or {})
    need = worst_case(
        job.prompt_tokens, int(params.get("max_new_tokens", 0)), BudgetBasis(ds.budget_basis)
    )
    conn.execute(update(Job).where(Job.id == job_id).values(reserved_tokens=need))
    # The dataset row is every worker's hot spot: touch it only with the last statement
    # before COMMIT, and only in single conditional UPDATEs (never a lock held across round
    # trips). Each branch of the ledger rule is one atomic predicate, or a fact that only
    # grows (used), so no decision needs a lock.
    reserved = _reserve_where(conn, job.dataset_id, need, _fits(need)) or _reserve_where(
        conn, job.dataset_id, need, _nothing_held()
    )
    if not reserved:
        conn.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                state=JobState.SKIPPED_BUDGET.value,
                attempts=Job.attempts - 1,
                worker=None,
                lease_until=None,
                reserved_tokens=0,
            )
        )
        if not _skip_if_spent(conn, job.dataset_id):
            raise _Rollback("deferred")  # undoes the skip above
        return Claim("skipped")
    return Claim(
        "claimed",
        ClaimedJob(
            id=int(job.id),
            dataset_id=int(job.dataset_id),
            input_ids=list(job.input_ids),
            sampling_params=params,
            attempts=int(job.attempts),
            reserved_tokens=need,
            think_end_id=ds.think_end_id if job.opens_reasoning else None,
            vocab_size=ds.vocab_size,
            run=ds.run,
            dataset=ds.name,
        ),
    )


def _fits(need: int) -> ColumnElement[bool]:
    """The job's worst case fits next to what is settled and held (or there is no budget)."""
    return or_(
        Dataset.budget_tokens.is_(None),
        Dataset.used_tokens + Dataset.reserved_tokens + need <= Dataset.budget_tokens,
    )


def _nothing_held() -> ColumnElement[bool]:
    """Nothing is held and the budget is not spent: run even a job larger than the rest."""
    return and_(Dataset.reserved_tokens == 0, Dataset.used_tokens < Dataset.budget_tokens)


def _reserve_where(
    conn: Connection, dataset_id: int, need: int, condition: ColumnElement[bool]
) -> bool:
    """Reserve ``need`` in the dataset's ledger if ``condition`` holds, in one statement
    (which also counts the job as running)."""
    reserved = conn.scalar(
        update(Dataset)
        .where(Dataset.id == dataset_id, condition)
        .values(
            reserved_tokens=Dataset.reserved_tokens + need,
            **moved(JobState.QUEUED, JobState.RUNNING),
        )
        .returning(Dataset.id)
    )
    return reserved is not None


def _skip_if_spent(conn: Connection, dataset_id: int) -> bool:
    """Count one queued job as skipped if settled usage reached the budget; whether it did.

    One conditional UPDATE, so the check and the count are atomic: the row lock it takes
    makes a concurrent `budget set` (which locks the row for update) wait for this skip, and
    the set's re-queue then covers it.
    """
    skipped = conn.scalar(
        update(Dataset)
        .where(Dataset.id == dataset_id, Dataset.used_tokens >= Dataset.budget_tokens)
        .values(moved(JobState.QUEUED, JobState.SKIPPED_BUDGET))
        .returning(Dataset.id)
    )
    return skipped is not None


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
        "last_error": None if error is None else error[:4000],
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


def generation_values(gen: GenerationRecord) -> dict[str, Any]:
    """Column values of a generation row."""
    return {
        "output_ids": gen.output_ids,
        "finish_type": gen.finish_type,
        "finish_matched": gen.finish_matched,
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": gen.e2e_latency,
        "server": gen.server,
        "meta_info": gen.meta_info,
        "think_end_present": gen.think_end_present,
        "reasoning_tokens": gen.reasoning_tokens,
        "answer_tokens": gen.answer_tokens,
    }
