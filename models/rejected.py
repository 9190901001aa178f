"""The rows that never became jobs (`eaglegen rejected`): listed, and counted by reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine, func, select

from models.db import snapshot
from models.schema import Dataset, RejectedRow, Run


class UnknownRunError(ValueError):
    """No run of that name, or no dataset of that name in it."""


@dataclass(frozen=True)
class RejectedEntry:
    """One rejected row: where it was, why it was refused, and how it began."""

    dataset: str
    row_index: int
    reason: str
    excerpt: str


@dataclass(frozen=True)
class RejectedListing:
    """The first rows that match (dataset and row order), and how many match by reason."""

    run: str
    rows: list[RejectedEntry]
    by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every matching row, listed or not."""
        return sum(self.by_reason.values())


class RejectedQueries:
    """Mixin of the Repository for `eaglegen rejected`."""

    engine: Engine

    def rejected(
        self,
        run: str,
        *,
        dataset: str | None = None,
        reason: str | None = None,
        limit: int | None = None,
    ) -> RejectedListing:
        """The run's rejected rows (of one dataset, of one reason), at most ``limit`` of
        them (None: all), with the count of every matching row by reason; UnknownRunError
        naming what exists when the run or the dataset does not."""
        with snapshot(self.engine) as conn:  # the count agrees with the rows listed
            run_id = conn.scalar(select(Run.id).where(Run.name == run))
            if run_id is None:
                raise UnknownRunError(f"run {run!r} not found (`eaglegen status` lists the runs)")
            datasets = list(
                conn.scalars(
                    select(Dataset.name).where(Dataset.run_id == run_id).order_by(Dataset.name)
                )
            )
            if dataset is not None and dataset not in datasets:
                have = ", ".join(map(repr, datasets)) or "none"
                raise UnknownRunError(f"run {run!r} has no dataset {dataset!r} (it has {have})")
            matching = [Dataset.run_id == run_id]
            if dataset is not None:
                matching.append(Dataset.name == dataset)
            if reason is not None:
                matching.append(RejectedRow.reason == reason)
            listed = (
                select(Dataset.name, RejectedRow.row_index, RejectedRow.reason, RejectedRow.excerpt)
                .join(Dataset, Dataset.id == RejectedRow.dataset_id)
                .where(*matching)
                .order_by(Dataset.name, RejectedRow.row_index)
                .limit(limit)
            )
            counted = (
                select(RejectedRow.reason, func.count())
                .join(Dataset, Dataset.id == RejectedRow.dataset_id)
                .where(*matching)
                .group_by(RejectedRow.reason)
                .order_by(func.count().desc(), RejectedRow.reason)
            )
            rows = [
                RejectedEntry(str(d), int(i), str(r), str(e)) for d, i, r, e in conn.execute(listed)
            ]
            by_reason = {str(r): int(n) for r, n in conn.execute(counted)}
        return RejectedListing(run, rows, by_reason)
