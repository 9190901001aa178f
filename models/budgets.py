"""Queries of live budgets: show them, change them, re-queue what a raise allows."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, func, select, update

from models.counters import moved
from models.schema import Dataset, Job, Run
from models.states import JobState


class UnknownDatasetError(ValueError):
    """No dataset of that name (in that run)."""


@dataclass(frozen=True)
class BudgetRow:
    """One dataset's budget and ledger."""

    run: str
    dataset: str
    dataset_id: int
    budget_tokens: int | None
    budget_basis: str
    used_tokens: int
    reserved_tokens: int
    skipped_jobs: int


class BudgetQueries:
    """Mixin of the Repository for `eaglegen budget`."""

    engine: Engine

    def budgets(self, run: str | None = None) -> list[BudgetRow]:
        """Every dataset's budget, used and reserved tokens, and skipped jobs."""
        skipped = (
            select(func.count())
            .where(Job.dataset_id == Dataset.id, Job.state == JobState.SKIPPED_BUDGET.value)
            .correlate(Dataset)
            .scalar_subquery()
        )
        stmt = (
            select(
                Run.name,
                Dataset.name,
                Dataset.id,
                Dataset.budget_tokens,
                Dataset.budget_basis,
                Dataset.used_tokens,
                Dataset.reserved_tokens,
                skipped,
            )
            .join(Run, Run.id == Dataset.run_id)
            .order_by(Run.name, Dataset.name)
        )
        if run is not None:
            stmt = stmt.where(Run.name == run)
        with self.engine.connect() as conn:
            return [BudgetRow(*row) for row in conn.execute(stmt)]

    def budget_of(self, dataset_id: int) -> int | None:
        """A dataset's budget in tokens (None: unlimited)."""
        with self.engine.connect() as conn:
            return conn.scalar(select(Dataset.budget_tokens).where(Dataset.id == dataset_id))

    def set_budget(self, run: str | None, dataset: str, budget: int | None) -> list[int]:
        """Change a dataset's budget; jobs it no longer holds back are re-queued, for the
        feeder to publish (their ids)."""
        with self.engine.begin() as conn:
            stmt = select(Dataset.id, Dataset.used_tokens).join(Run, Run.id == Dataset.run_id)
            stmt = stmt.where(Dataset.name == dataset).with_for_update(of=Dataset)
            if run is not None:
                stmt = stmt.where(Run.name == run)
            rows = conn.execute(stmt).all()
            if len(rows) != 1:
                where = f" in run {run!r}" if run else ""
                problem = "no" if not rows else "more than one (pass --run)"
                raise UnknownDatasetError(f"{problem} dataset named {dataset!r}{where}")
            dataset_id, used = rows[0]
            conn.execute(
                update(Dataset).where(Dataset.id == dataset_id).values(budget_tokens=budget)
            )
            if budget is not None and used >= budget:
                return []
            requeued = conn.scalars(
                update(Job)
                .where(Job.dataset_id == dataset_id, Job.state == JobState.SKIPPED_BUDGET.value)
                .values(
                    state=JobState.QUEUED.value,
                    published_at=None,
                    not_before=None,
                    updated_at=func.now(),
                )
                .returning(Job.id)
            ).all()
            conn.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id)
                .values(moved(JobState.SKIPPED_BUDGET, JobState.QUEUED, len(requeued)))
            )
            return sorted(int(i) for i in requeued)
