"""Queries of the feeder (worker.feeder): what each dataset has left, and taking the next
jobs of a dataset in its order to publish them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, or_, select, update

from models.counters import moved
from models.schema import Dataset, Job, Run
from models.states import JobState

QUEUED = JobState.QUEUED.value


@dataclass(frozen=True)
class FeedDataset:
    """One dataset with queued jobs, as the feeder weighs it."""

    dataset_id: int
    run: str
    dataset: str
    budget_tokens: int | None
    used_tokens: int
    reserved_tokens: int
    queued: int  # queued jobs, with a message out or not
    published: int  # queued jobs with a message out
    taken: int  # jobs done, running or failed
    done: int
    max_new_tokens: int

    @property
    def ready(self) -> int:
        """Queued jobs without a message out (some may wait out a backoff)."""
        return max(0, self.queued - self.published)

    @property
    def spent(self) -> bool:
        """The budget is reached by settled usage alone: its queued jobs are skipped."""
        return self.budget_tokens is not None and self.used_tokens >= self.budget_tokens


class FeedQueries:
    """Mixin of the Repository for the feeder."""

    engine: Engine

    def feed_datasets(self) -> list[FeedDataset]:
        """Every dataset that has queued jobs, by id."""
        published = (
            select(Job.dataset_id, func.count().label("n"))
            .where(Job.state == QUEUED, Job.published_at.is_not(None))
            .group_by(Job.dataset_id)
            .subquery()
        )
        stmt = (
            select(
                Dataset.id,
                Run.name,
                Dataset.name,
                Dataset.budget_tokens,
                Dataset.used_tokens,
                Dataset.reserved_tokens,
                Dataset.jobs_queued,
                func.coalesce(published.c.n, 0),
                Dataset.jobs_done + Dataset.jobs_running + Dataset.jobs_failed,
                Dataset.jobs_done,
                Dataset.sampling_params["max_new_tokens"].as_integer(),
            )
            .join(Run, Run.id == Dataset.run_id)
            .outerjoin(published, published.c.dataset_id == Dataset.id)
            .where(Dataset.jobs_queued > 0)
            .order_by(Dataset.id)
        )
        with self.engine.connect() as conn:
            return [_feed_dataset(row) for row in conn.execute(stmt)]

    def take_next(
        self,
        counts: Mapping[int, int],
        publish: Callable[[dict[int, list[int]]], None],
    ) -> dict[int, list[int]]:
        """Mark the next ``counts[d]`` ready jobs of each dataset ``d`` (in its order) as
        published and hand them to ``publish`` before committing: the ids per dataset.

        A publish that fails rolls the marks back, so no job is marked without a message.
        Jobs another transaction holds are passed over (SKIP LOCKED).
        """
        taken: dict[int, list[int]] = {}
        with self.engine.begin() as conn:
            for dataset_id, n in counts.items():
                if n > 0:
                    taken[dataset_id] = _take(conn, dataset_id, n)
            publish(taken)
        return taken

    def skip_spent(self, dataset_id: int) -> tuple[int, list[int]]:
        """Skip the unpublished queued jobs of a dataset whose budget is spent (none when it
        is not): how many, and the ids of those that had a message before (an attempt or a
        deferral), which Flower knows. `budget set` re-queues them (models.budgets)."""
        with self.engine.begin() as conn:
            spent = conn.scalar(
                select(Dataset.id)
                .where(Dataset.id == dataset_id, Dataset.used_tokens >= Dataset.budget_tokens)
                .with_for_update()
            )
            if spent is None:
                return 0, []
            # SKIP LOCKED: a job a worker is claiming right now (it holds the job's row and
            # waits for this dataset row) is left to that claim, which skips it itself.
            ids = (
                select(Job.id)
                .where(
                    Job.dataset_id == dataset_id, Job.state == QUEUED, Job.published_at.is_(None)
                )
                .with_for_update(skip_locked=True)
            )
            rows = conn.execute(
                update(Job)
                .where(Job.id.in_(ids.scalar_subquery()))
                .values(state=JobState.SKIPPED_BUDGET.value, not_before=None, updated_at=func.now())
                .returning(Job.id, (Job.attempts > 0) | Job.last_error.is_not(None))
            ).all()
            if rows:
                conn.execute(
                    update(Dataset)
                    .where(Dataset.id == dataset_id)
                    .values(moved(JobState.QUEUED, JobState.SKIPPED_BUDGET, len(rows)))
                )
            return len(rows), sorted(int(job) for job, known in rows if known)

    def defer(self, job_id: int, delay_s: float, reason: str) -> None:
        """Send a queued job back to the feeder, not to be published for ``delay_s``; the
        reason is its last error."""
        with self.engine.begin() as conn:
            conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == QUEUED)
                .values(published_at=None, not_before=_after(delay_s), last_error=reason)
            )

    def published_job_ids(self, older_than_s: float) -> list[int]:
        """Queued jobs whose message went out more than ``older_than_s`` ago."""
        stmt = select(Job.id).where(
            Job.state == QUEUED,
            Job.published_at < func.now() - timedelta(seconds=older_than_s),
        )
        with self.engine.connect() as conn:
            return sorted(int(i) for i in conn.scalars(stmt))

    def unpublish(self, job_ids: Sequence[int], older_than_s: float) -> int:
        """Give jobs whose message was lost back to the feeder (those still queued and
        published more than ``older_than_s`` ago); how many."""
        if not job_ids:
            return 0
        with self.engine.begin() as conn:
            return int(
                conn.execute(
                    update(Job)
                    .where(
                        Job.id.in_(job_ids),
                        Job.state == QUEUED,
                        Job.published_at < func.now() - timedelta(seconds=older_than_s),
                    )
                    .values(published_at=None)
                ).rowcount
            )


def _feed_dataset(row: Any) -> FeedDataset:
    (dataset_id, run, name, budget, used, reserved, queued, published, taken, done, max_new) = row
    return FeedDataset(
        dataset_id=int(dataset_id),
        run=run,
        dataset=name,
        budget_tokens=None if budget is None else int(budget),
        used_tokens=int(used),
        reserved_tokens=int(reserved),
        queued=int(queued),
        published=int(published),
        taken=int(taken),
        done=int(done),
        max_new_tokens=int(max_new or 0),  # every dataset's params are complete (core.sampling)
    )


def _take(conn: Connection, dataset_id: int, n: int) -> list[int]:
    """The next ``n`` ready jobs of one dataset, marked published, in the dataset's order."""
    ready = (
        select(Job.id)
        .where(
            Job.dataset_id == dataset_id,
            Job.state == QUEUED,
            Job.published_at.is_(None),
            or_(Job.not_before.is_(None), Job.not_before <= func.now()),
        )
        .order_by(Job.sort_key, Job.id)
        .limit(n)
        .with_for_update(skip_locked=True)
    )
    rows = conn.execute(
        update(Job)
        .where(Job.id.in_(ready.scalar_subquery()))
        .values(published_at=func.now(), not_before=None)
        .returning(Job.id, Job.sort_key)
    ).all()
    return [int(r.id) for r in sorted(rows, key=lambda r: (r.sort_key, r.id))]


def _after(delay_s: float) -> object:
    """``now() + delay_s`` in SQL, or None for no delay."""
    return func.now() + timedelta(seconds=delay_s) if delay_s > 0 else None
