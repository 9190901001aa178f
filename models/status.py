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

from sqlalchemy import Engine, Select, column, func, select, table, text
from sqlalchemy.dialects.postgresql import JSONB

from core.samples import variants_of
from models.ledger import BudgetBasis, ReservePolicy, reservation
from models.records import DatasetStatus, ServerStatus, StatusSnapshot, Window
from models.states import JobState

# The windows rates are measured over, in seconds, shortest first; the longest bounds
# every scan.
WINDOWS_S = (60, 600)

# The columns status reads, as plain tables named as in models.schema: `eaglegen status`
# runs without importing the ORM (BENCHMARKS.md, "CLI start-up"); tests/unit/
# test_schema_reads.py checks each column against models.schema.
_RUNS = table("runs", column("id"), column("name"), column("order_seed"), column("family"))
_DATASETS = table(
    "datasets",
    column("id"),
    column("run_id"),
    column("name"),
    column("sampling_params", JSONB),
    column("budget_tokens"),
    column("budget_basis"),
    column("used_tokens"),
    column("reserved_tokens"),
    column("reserve"),
    column("observed_reserve_tokens"),
    column("jobs_queued"),
    column("jobs_running"),
    column("jobs_done"),
    column("jobs_failed"),
    column("jobs_skipped"),
    column("done_prompt_tokens"),
    column("done_completion_tokens"),
    column("first_done_at"),
    column("last_done_at"),
    column("turns"),
    column("samples"),
    column("variants"),
)
_CONVERSATIONS = table(
    "conversations",
    column("dataset_id"),
    column("state"),
    column("ended_reason"),
    column("points"),
    column("turns"),
)
_JOBS = table("jobs", column("dataset_id"), column("state"), column("published_at"))
_GENERATIONS = table(
    "generations",
    column("dataset_id"),
    column("prompt_tokens"),
    column("completion_tokens"),
    column("e2e_latency"),
    column("server"),
    column("created_at"),
)
_FAILED_ATTEMPTS = table(
    "failed_attempts", column("dataset_id"), column("server"), column("kind"), column("at")
)
_STATE_COLUMNS = {
    JobState.QUEUED: _DATASETS.c.jobs_queued,
    JobState.RUNNING: _DATASETS.c.jobs_running,
    JobState.DONE: _DATASETS.c.jobs_done,
    JobState.FAILED: _DATASETS.c.jobs_failed,
    JobState.SKIPPED_BUDGET: _DATASETS.c.jobs_skipped,
}


class StatusQueries:
    """Mixin of the Repository: the functions below as its methods."""

    engine: Engine

    def status(self, run: str | None = None) -> StatusSnapshot:
        """Every dataset (of ``run``, or of all runs) and server, as of one instant."""
        return read_status(self.engine, run)

    def postgres_connections(self) -> tuple[int, int]:
        """Client connections open on the server now, and its ``max_connections``."""
        return postgres_connections(self.engine)


def read_status(engine: Engine, run: str | None = None) -> StatusSnapshot:
    """Every dataset (of ``run``, or of all runs) and server, as of one instant."""
    with engine.begin() as conn:  # one transaction: one now() for every figure
        now = conn.execute(select(func.now())).scalar_one()
        datasets = conn.execute(_datasets(run)).all()
        recent = conn.execute(_recent_generations()).all()
        errors = conn.execute(_recent_errors()).all()
        published = dict(conn.execute(_published()).all())
        seeds = dict(conn.execute(select(_RUNS.c.name, _RUNS.c.order_seed)).all())
        families = dict(conn.execute(select(_RUNS.c.name, _RUNS.c.family)).all())
        conversations = conn.execute(_conversations()).all()
    ours = {int(d.id) for d in datasets}
    recent = [r for r in recent if r.dataset_id in ours]
    errors = [e for e in errors if e.dataset_id in ours]
    return StatusSnapshot(
        now=now,
        windows_s=WINDOWS_S,
        datasets=[
            _dataset(
                d,
                [r for r in recent if r.dataset_id == d.id],
                now,
                [c for c in conversations if c.dataset_id == d.id],
            )
            for d in datasets
        ],
        servers=_servers(recent, errors, now),
        unattributed_errors=_unattributed(errors),
        order_seeds={r: int(seeds[r]) for r in sorted({d.run for d in datasets})},
        families={r: families[r] for r in sorted({d.run for d in datasets})},
        published=sum(int(published.get(d, 0)) for d in ours),
    )


def postgres_connections(engine: Engine) -> tuple[int, int]:
    """Client connections open on the server now, and its ``max_connections``."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE backend_type = 'client backend'),"
                " current_setting('max_connections')::int FROM pg_stat_activity"
            )
        ).one()
    return int(row[0]), int(row[1])


def _datasets(run: str | None) -> Select[*tuple[Any, ...]]:
    stmt = select(
        _DATASETS.c.id,
        _DATASETS.c.name,
        _RUNS.c.name.label("run"),
        *(counter.label(state.value) for state, counter in _STATE_COLUMNS.items()),
        _DATASETS.c.done_prompt_tokens,
        _DATASETS.c.done_completion_tokens,
        _DATASETS.c.budget_tokens,
        _DATASETS.c.budget_basis,
        _DATASETS.c.used_tokens,
        _DATASETS.c.reserved_tokens,
        _DATASETS.c.first_done_at,
        _DATASETS.c.last_done_at,
        _DATASETS.c.reserve,
        _DATASETS.c.observed_reserve_tokens,
        _DATASETS.c.turns,
        _DATASETS.c.samples,
        _DATASETS.c.variants,
        _DATASETS.c.sampling_params["max_new_tokens"].as_integer().label("max_new_tokens"),
    ).join(_RUNS, _RUNS.c.id == _DATASETS.c.run_id)
    stmt = stmt.order_by(_RUNS.c.name, _DATASETS.c.name)
    return stmt if run is None else stmt.where(_RUNS.c.name == run)


def _published() -> Select[*tuple[Any, ...]]:
    """Queued jobs with a message out, per dataset (a few: the window), by partial index."""
    return (
        select(_JOBS.c.dataset_id, func.count())
        .where(_JOBS.c.state == JobState.QUEUED.value, _JOBS.c.published_at.is_not(None))
        .group_by(_JOBS.c.dataset_id)
    )


def _since(seconds: int) -> Any:
    return func.now() - timedelta(seconds=seconds)


def _recent_generations() -> Select[*tuple[Any, ...]]:
    """Per dataset and server, completions and tokens within each window, and when the
    earliest generation of each window started."""
    started = _GENERATIONS.c.created_at - func.make_interval(
        0, 0, 0, 0, 0, 0, _GENERATIONS.c.e2e_latency
    )
    columns = []
    for seconds in WINDOWS_S:
        within = _GENERATIONS.c.created_at > _since(seconds)
        columns += [
            func.count().filter(within).label(f"n_{seconds}"),
            func.coalesce(func.sum(_GENERATIONS.c.completion_tokens).filter(within), 0).label(
                f"completion_{seconds}"
            ),
            func.coalesce(func.sum(_GENERATIONS.c.prompt_tokens).filter(within), 0).label(
                f"prompt_{seconds}"
            ),
            func.min(started).filter(within).label(f"started_{seconds}"),
        ]
    return (
        select(_GENERATIONS.c.dataset_id, _GENERATIONS.c.server, *columns)
        .where(_GENERATIONS.c.created_at > _since(max(WINDOWS_S)))
        .group_by(_GENERATIONS.c.dataset_id, _GENERATIONS.c.server)
    )


def _recent_errors() -> Select[*tuple[Any, ...]]:
    """Failed attempts per dataset, server and class within the longest window."""
    return (
        select(
            _FAILED_ATTEMPTS.c.dataset_id,
            _FAILED_ATTEMPTS.c.server,
            _FAILED_ATTEMPTS.c.kind,
            func.count().label("n"),
        )
        .where(_FAILED_ATTEMPTS.c.at > _since(max(WINDOWS_S)))
        .group_by(_FAILED_ATTEMPTS.c.dataset_id, _FAILED_ATTEMPTS.c.server, _FAILED_ATTEMPTS.c.kind)
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


def _conversations() -> Select[*tuple[Any, ...]]:
    """Conversations by dataset, state and end reason, with the turns still to come of
    those under way (a scan of the conversations: one row per multi-turn row, far fewer
    than the jobs)."""
    c = _CONVERSATIONS.c
    under_way = c.state.in_(("active", "waiting"))
    return select(
        c.dataset_id,
        c.state,
        c.ended_reason,
        func.count().label("n"),
        func.coalesce(func.sum(c.points - c.turns).filter(under_way), 0).label("to_come"),
        func.coalesce(func.sum(c.turns), 0).label("turns"),
        func.coalesce(func.sum(c.points), 0).label("points"),
    ).group_by(c.dataset_id, c.state, c.ended_reason)


def _dataset(
    row: Any, recent: Sequence[Any], now: datetime, conversations: Sequence[Any] = ()
) -> DatasetStatus:
    by_state: Counter[str] = Counter()
    for c in conversations:
        by_state[c.state if c.ended_reason is None else f"ended: {c.ended_reason}"] += int(c.n)
    return DatasetStatus(
        samples=int(row.samples),
        variants=tuple((v.name, v.weight) for v in variants_of(row.variants)),
        turns=str(row.turns),
        conversations=dict(by_state),
        turns_to_come=_turns_to_come(conversations),
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


def _turns_to_come(conversations: Sequence[Any]) -> int:
    """The turns the conversations under way will still have: their answer points left, at
    the share of its points that a finished conversation reached (some end early); all of
    them while none has finished."""
    finished = [c for c in conversations if c.state in ("done", "ended")]
    points = sum(int(c.points) for c in finished)
    reached = sum(int(c.turns) for c in finished) / points if points else 1.0
    return round(sum(int(c.to_come) for c in conversations) * reached)


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
