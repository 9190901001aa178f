"""Queries of live budgets: show them, change them, re-queue what a raise allows."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, func, select, update

from models.counters import moved
from models.ledger import BudgetBasis
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


@dataclass(frozen=True)
class BudgetChange:
    """What a budget change did, and what was in flight when it was made."""

    budget_tokens: int | None
    used_tokens: int
    running_jobs: int
    reserved_tokens: int  # held by the running jobs
    # What the running jobs may settle at most: their worst case, which is more than they
    # hold when the dataset reserves from observed lengths (models.ledger.reservation).
    worst_case_tokens: int
    requeued: list[int]  # skipped jobs queued again (ids)

    @property
    def may_exceed_by(self) -> int:
        """How far the running jobs may take the dataset over the new budget: requests in
        flight are never cancelled, and each may settle up to its worst case (0: they fit)."""
        if self.budget_tokens is None or not self.running_jobs:
            return 0
        return max(self.used_tokens + self.worst_case_tokens - self.budget_tokens, 0)


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
        return self.change_budget(run, dataset, budget).requeued

    def change_budget(self, run: str | None, dataset: str, budget: int | None) -> BudgetChange:
        """Change a dataset's budget; jobs it no longer holds back are re-queued, for the
        feeder to publish. Also what was running at that moment (the dataset row is locked:
        the ledger cannot move meanwhile)."""
        with self.engine.begin() as conn:
            stmt = select(
                Dataset.id,
                Dataset.used_tokens,
                Dataset.jobs_running,
                Dataset.reserved_tokens,
                Dataset.sampling_params,
                Dataset.budget_basis,
            ).join(Run, Run.id == Dataset.run_id)
            stmt = stmt.where(Dataset.name == dataset).with_for_update(of=Dataset)
            if run is not None:
                stmt = stmt.where(Run.name == run)
            rows = conn.execute(stmt).all()
            if len(rows) != 1:
                where = f" in run {run!r}" if run else ""
                problem = "no" if not rows else "more than one (pass --run)"
                raise UnknownDatasetError(f"{problem} dataset named {dataset!r}{where}")
            dataset_id, used, running, reserved, params, basis = rows[0]
            worst = int(running) * int((params or {}).get("max_new_tokens", 0))
            if BudgetBasis(basis) is BudgetBasis.TOTAL:
                prompts = select(func.coalesce(func.sum(Job.prompt_tokens), 0)).where(
                    Job.dataset_id == dataset_id, Job.state == JobState.RUNNING.value
                )
                worst += int(conn.scalar(prompts) or 0)
            conn.execute(
                update(Dataset).where(Dataset.id == dataset_id).values(budget_tokens=budget)
            )

            def change(requeued: list[int]) -> BudgetChange:
                return BudgetChange(
                    budget,
                    int(used),
                    int(running),
                    int(reserved),
                    max(worst, int(reserved)),
                    requeued,
                )

            if budget is not None and used >= budget:
                return change([])
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
            return change(sorted(int(i) for i in requeued))
