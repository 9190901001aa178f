"""The queries of `eaglegen status`: counters and the last minutes, never a scan of a run.

Jobs by state and done tokens come from the dataset rows (models.counters); rates come from
the generations and failed attempts of the last minutes (WINDOWS_S), read through their
time indexes. So a status costs the same on a run of a million jobs as on a thousand.

Each window also says how much of it the work spans (``Window.covered_s``): from the start
of its earliest generation (recorded at ``created_at``, after ``e2e_latency`` seconds of
work) to now. In a run's first minutes a window is mostly time before anything was sent.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Select, func, select

from models.ledger import BudgetBasis, ReservePolicy, reservation
from models.records import DatasetStatus, ServerStatus, StatusSnapshot, Window
from models.schema import Dataset, FailedAttempt, Generation, Job, Run
from models.states import JobState

# The windows rates are measured over, in seconds, shortest first; the longest bounds
# every scan.
WINDOWS_S = (60, 600)
_STATE_COLUMNS = {
    JobState.QUEUED: Dataset.jobs_queued,
    JobState.RUNNING: Dataset.jobs_running,
    JobState.DONE: Dataset.jobs_done,
    JobState.FAILED: Dataset.jobs_failed,
    JobState.SKIPPED_BUDGET: Dataset.jobs_skipped,
}


class StatusQueries:
    """Mixin of the Repository: one consistent snapshot of the datasets and servers."""

    engine: Engine

    def status(self, run: str | None = None) -> StatusSnapshot:
        """Every dataset (of ``run``, or of all runs) and server, as of one instant."""
        with self.engine.begin() as conn:  # one transaction: one now() for every figure
            now = conn.execute(select(func.now())).scalar_one()
            datasets = conn.execute(_datasets(run)).all()
            recent = conn.execute(_recent_generations()).all()
            errors = conn.execute(_recent_errors()).all()
            published = dict(conn.execute(_published()).all())
            seeds = dict(conn.execute(select(Run.name, Run.order_seed)).all())
            families = dict(conn.execute(select(Run.name, Run.family)).all())
        ours = {int(d.id) for d in datasets}
        recent = [r for r in recent if r.dataset_id in ours]
        errors = [e for e in errors if e.dataset_id in ours]
        return StatusSnapshot(
            now=now,
            windows_s=WINDOWS_S,
            datasets=[
                _dataset(d, [r for r in recent if r.dataset_id == d.id], now) for d in datasets
            ],
            servers=_servers(recent, errors, now),
            unattributed_errors=_unattributed(errors),
            order_seeds={r: int(seeds[r]) for r in sorted({d.run for d in datasets})},
            families={r: families[r] for r in sorted({d.run for d in datasets})},
            published=sum(int(published.get(d, 0)) for d in ours),
        )


def _datasets(run: str | None) -> Select[*tuple[Any, ...]]:
    stmt = select(
        Dataset.id,
        Dataset.name,
        Run.name.label("run"),
        *(column.label(state.value) for state, column in _STATE_COLUMNS.items()),
        Dataset.done_prompt_tokens,
        Dataset.done_completion_tokens,
        Dataset.budget_tokens,
        Dataset.budget_basis,
        Dataset.used_tokens,
        Dataset.reserved_tokens,
        Dataset.first_done_at,
        Dataset.last_done_at,
        Dataset.reserve,
        Dataset.observed_reserve_tokens,
        Dataset.sampling_params["max_new_tokens"].as_integer().label("max_new_tokens"),
    ).join(Run, Run.id == Dataset.run_id)
    stmt = stmt.order_by(Run.name, Dataset.name)
    return stmt if run is None else stmt.where(Run.name == run)


def _published() -> Select[*tuple[Any, ...]]:
    """Queued jobs with a message out, per dataset (a few: the window), by partial index."""
    return (
        select(Job.dataset_id, func.count())
        .where(Job.state == JobState.QUEUED.value, Job.published_at.is_not(None))
        .group_by(Job.dataset_id)
    )


def _since(seconds: int) -> Any:
    return func.now() - timedelta(seconds=seconds)


def _recent_generations() -> Select[*tuple[Any, ...]]:
    """Per dataset and server, completions and tokens within each window, and when the
    earliest generation of each window started."""
    started = Generation.created_at - func.make_interval(0, 0, 0, 0, 0, 0, Generation.e2e_latency)
    columns = []
    for seconds in WINDOWS_S:
        within = Generation.created_at > _since(seconds)
        columns += [
            func.count().filter(within).label(f"n_{seconds}"),
            func.coalesce(func.sum(Generation.completion_tokens).filter(within), 0).label(
                f"completion_{seconds}"
            ),
            func.coalesce(func.sum(Generation.prompt_tokens).filter(within), 0).label(
                f"prompt_{seconds}"
            ),
            func.min(started).filter(within).label(f"started_{seconds}"),
        ]
    return (
        select(Generation.dataset_id, Generation.server, *columns)
        .where(Generation.created_at > _since(max(WINDOWS_S)))
        .group_by(Generation.dataset_id, Generation.server)
    )


def _recent_errors() -> Select[*tuple[Any, ...]]:
    """Failed attempts per dataset, server and class within the longest window."""
    return (
        select(
            FailedAttempt.dataset_id,
            FailedAttempt.server,
            FailedAttempt.kind,
            func.count().label("n"),
        )
        .where(FailedAttempt.at > _since(max(WINDOWS_S)))
        .group_by(FailedAttempt.dataset_id, FailedAttempt.server, FailedAttempt.kind)
    )


def _windows(rows: Sequence[Any], now: datetime) -> tuple[Window, ...]:
    """The rows' sums, one Window per length in WINDOWS_S."""
    return tuple(
        Window(
            seconds=s,
            completions=sum(int(getattr(r, f"n_{s}")) for r in rows),
            completion_tokens=sum(int(getattr(r, f"completion_{s}")) for r in rows),
            prompt_tokens=sum(int(getattr(r, f"prompt_{s}")) for r in rows),
            covered_s=_covered(s, [getattr(r, f"started_{s}") for r in rows], now),
        )
        for s in WINDOWS_S
    )


def _covered(seconds: int, starts: Sequence[datetime | None], now: datetime) -> float | None:
    """Seconds from the earliest of ``starts`` to ``now``, at most the window's; None
    without a start (no generation in the window)."""
    known = [s for s in starts if s is not None]
    if not known:
        return None
    return min(float(seconds), max(0.0, (now - min(known)).total_seconds()))


def _dataset(row: Any, recent: Sequence[Any], now: datetime) -> DatasetStatus:
    return DatasetStatus(
        run=row.run,
        dataset=row.name,
        states={state.value: int(getattr(row, state.value)) for state in JobState},
        done_prompt_tokens=int(row.done_prompt_tokens),
        done_completion_tokens=int(row.done_completion_tokens),
        budget_tokens=None if row.budget_tokens is None else int(row.budget_tokens),
        budget_basis=str(row.budget_basis),
        used_tokens=int(row.used_tokens),
        reserved_tokens=int(row.reserved_tokens),
        first_done_at=row.first_done_at,
        last_done_at=row.last_done_at,
        windows=_windows(recent, now),
        reserve=str(row.reserve),
        reserve_tokens=_reserve_tokens(row),
    )


def _reserve_tokens(row: Any) -> int | None:
    """The completion tokens the dataset's next claim reserves (models.attempt's rule)."""
    if row.max_new_tokens is None:
        return None
    observed = row.observed_reserve_tokens if row.reserve == ReservePolicy.OBSERVED else None
    return reservation(0, int(row.max_new_tokens), BudgetBasis.COMPLETION, observed)


def _unattributed(errors: Sequence[Any]) -> dict[str, int]:
    """Failed attempts no server is to blame for, by class, over every dataset."""
    counts: Counter[str] = Counter()
    for error in errors:
        if error.server is None:
            counts[error.kind] += int(error.n)
    return dict(counts)


def _servers(recent: Sequence[Any], errors: Sequence[Any], now: datetime) -> list[ServerStatus]:
    by_server: dict[str, list[Any]] = defaultdict(list)
    for row in recent:
        by_server[row.server].append(row)
    failures: dict[str, Counter[str]] = defaultdict(Counter)
    for error in errors:
        if error.server is not None:
            failures[error.server][error.kind] += int(error.n)
    return [
        ServerStatus(name=name, windows=_windows(by_server[name], now), errors=dict(failures[name]))
        for name in sorted(by_server.keys() | failures.keys())
    ]
