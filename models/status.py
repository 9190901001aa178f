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
from datetime import datetime
from typing import TYPE_CHECKING, Any

from psycopg import Connection, Cursor
from psycopg.rows import namedtuple_row

from core.samples import variants_of
from models.ledger import BudgetBasis, ReservePolicy, reservation
from models.snapshot import DatasetStatus, ServerStatus, StatusSnapshot, Window
from models.states import COUNTER_COLUMN, JobState

# The Repository's engine is only a type here: `eaglegen status` reads through psycopg
# alone and imports no SQLAlchemy (models.pg; BENCHMARKS.md, "CLI start-up").
if TYPE_CHECKING:
    from sqlalchemy import Engine

# The windows rates are measured over, in seconds, shortest first; the longest bounds
# every scan.
WINDOWS_S = (60, 600)

_DATASETS = f"""
SELECT d.id, d.name, r.name AS run,
       {", ".join(f"d.{column} AS {state.value}" for state, column in COUNTER_COLUMN.items())},
       d.done_prompt_tokens, d.done_completion_tokens, d.budget_tokens, d.budget_basis,
       d.used_tokens, d.reserved_tokens, d.first_done_at, d.last_done_at, d.reserve,
       d.observed_reserve_tokens, d.turns, d.samples, d.variants,
       (d.sampling_params ->> 'max_new_tokens')::integer AS max_new_tokens
FROM datasets d JOIN runs r ON r.id = d.run_id
WHERE %(run)s::text IS NULL OR r.name = %(run)s
ORDER BY r.name, d.name
"""

# Queued jobs with a message out, per dataset (a few: the window), by partial index (the
# state is a literal, not a parameter: a plan psycopg prepares for a connection that asks
# often, `metrics`, must still match the index's predicate).
_PUBLISHED = f"""
SELECT dataset_id, count(*) FROM jobs
WHERE state = '{JobState.QUEUED.value}' AND published_at IS NOT NULL
GROUP BY dataset_id
"""


def _window_columns(seconds: int) -> str:
    """A window's completions, tokens, and the start of its earliest generation (recorded at
    created_at, after e2e_latency seconds of work)."""
    within = f"FILTER (WHERE created_at > now() - interval '{seconds} seconds')"
    return (
        f"count(*) {within} AS n_{seconds},"
        f" coalesce(sum(completion_tokens) {within}, 0) AS completion_{seconds},"
        f" coalesce(sum(prompt_tokens) {within}, 0) AS prompt_{seconds},"
        f" min(created_at - make_interval(0, 0, 0, 0, 0, 0, e2e_latency)) {within}"
        f" AS started_{seconds}"
    )


# Per dataset and server, each window's figures.
_RECENT_GENERATIONS = f"""
SELECT dataset_id, server, {", ".join(map(_window_columns, WINDOWS_S))}
FROM generations WHERE created_at > now() - interval '{max(WINDOWS_S)} seconds'
GROUP BY dataset_id, server
"""

# Failed attempts per dataset, server and class within the longest window.
_RECENT_ERRORS = f"""
SELECT dataset_id, server, kind, count(*) AS n FROM failed_attempts
WHERE at > now() - interval '{max(WINDOWS_S)} seconds'
GROUP BY dataset_id, server, kind
"""

# Conversations by dataset, state and end reason, with the turns still to come of those
# under way (a scan of the conversations: one row per multi-turn row, far fewer than the
# jobs).
_CONVERSATIONS = """
SELECT dataset_id, state, ended_reason, count(*) AS n,
       coalesce(sum(points - turns) FILTER (WHERE state IN ('active', 'waiting')), 0)
           AS to_come,
       coalesce(sum(turns), 0) AS turns, coalesce(sum(points), 0) AS points
FROM conversations
GROUP BY dataset_id, state, ended_reason
"""

_CONNECTIONS = """
SELECT count(*) FILTER (WHERE backend_type = 'client backend'),
       current_setting('max_connections')::int
FROM pg_stat_activity
"""


class StatusQueries:
    """Mixin of the Repository: the functions below as its methods, on a pooled
    connection's psycopg connection."""

    engine: Engine

    def status(self, run: str | None = None) -> StatusSnapshot:
        """Every dataset (of ``run``, or of all runs) and server, as of one instant."""
        from models.db import driver_connection

        with self.engine.connect() as pooled:
            return read_status(driver_connection(pooled), run)

    def postgres_connections(self) -> tuple[int, int]:
        """Client connections open on the server now, and its ``max_connections``."""
        from models.db import driver_connection

        with self.engine.connect() as pooled:
            return postgres_connections(driver_connection(pooled))


def read_status(conn: Connection[Any], run: str | None = None) -> StatusSnapshot:
    """Every dataset (of ``run``, or of all runs) and server, as of one instant."""
    with conn.transaction(), _named_rows(conn) as cursor:  # one transaction: one now()
        now = _one(cursor, "SELECT now()")
        datasets = cursor.execute(_DATASETS, {"run": run}).fetchall()
        recent = cursor.execute(_RECENT_GENERATIONS).fetchall()
        errors = cursor.execute(_RECENT_ERRORS).fetchall()
        published = dict(cursor.execute(_PUBLISHED))
        runs = {r.name: r for r in cursor.execute("SELECT name, order_seed, family FROM runs")}
        conversations = cursor.execute(_CONVERSATIONS).fetchall()
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
        order_seeds={r: int(runs[r].order_seed) for r in sorted({d.run for d in datasets})},
        families={r: runs[r].family for r in sorted({d.run for d in datasets})},
        published=sum(int(published.get(d, 0)) for d in ours),
    )


def postgres_connections(conn: Connection[Any]) -> tuple[int, int]:
    """Client connections open on the server now, and its ``max_connections``."""
    row = conn.execute(_CONNECTIONS).fetchone()
    assert row is not None, "an aggregate returns one row"
    return int(row[0]), int(row[1])


def _named_rows(conn: Connection[Any]) -> Cursor[Any]:
    """A cursor whose rows are named tuples (each column an attribute)."""
    return conn.cursor(row_factory=namedtuple_row)


def _one(cursor: Cursor[Any], sql: str) -> Any:
    row = cursor.execute(sql).fetchone()
    assert row is not None, "a SELECT without FROM returns one row"
    return row[0]


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
