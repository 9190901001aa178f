"""Invariant checks on a live database (`eaglegen audit`): each query names what it finds."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection, Engine, and_, case, func, select, text

from models.db import snapshot
from models.schema import Dataset, Generation, Job, Run
from models.states import COUNTER_COLUMN, JobState

DONE, RUNNING = JobState.DONE.value, JobState.RUNNING.value


class AuditQueries:
    """Mixin of the Repository: the invariants of docs/design.md §2, §4 and §13."""

    engine: Engine

    def audit(self, lease_grace_s: float) -> list[str]:
        """Every violated invariant, one sentence each; empty when all hold.

        Every check reads one snapshot (a REPEATABLE READ, read-only transaction): the
        checks compare figures read by separate statements (the jobs counted, then the
        datasets' counters), and on a live run transitions commit between statements.
        """
        with snapshot(self.engine) as conn:
            problems: list[str] = []
            missing = conn.scalar(
                select(func.count())
                .select_from(Job)
                .outerjoin(Generation, Generation.job_id == Job.id)
                .where(Job.state == DONE, Generation.job_id.is_(None))
            )
            if missing:
                problems.append(f"{missing} done job(s) have no generation")
            orphans = conn.scalar(
                select(func.count())
                .select_from(Generation)
                .join(Job, Job.id == Generation.job_id)
                .where(Job.state != DONE)
            )
            if orphans:
                problems.append(f"{orphans} generation(s) belong to jobs that are not done")
            problems += self._ledger_problems(conn)
            problems += _counter_problems(conn)
            problems += _conversation_problems(conn)
            stale = conn.scalar(
                select(func.count())
                .select_from(Job)
                .where(
                    Job.state == RUNNING,
                    Job.lease_until < func.now() - timedelta(seconds=lease_grace_s),
                )
            )
            if stale:
                problems.append(
                    f"{stale} running job(s) hold a lease that expired more than "
                    f"{lease_grace_s:.0f} s ago (is a reconciler running?)"
                )
            held = conn.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.state != RUNNING, Job.reserved_tokens != 0)
            )
            if held:
                problems.append(f"{held} job(s) not running still hold budget")
        return problems

    def _ledger_problems(self, conn: Connection) -> list[str]:
        settled = func.coalesce(
            func.sum(
                Generation.completion_tokens
                + case((Dataset.budget_basis == "total", Generation.prompt_tokens), else_=0)
            ),
            0,
        )
        reserved = func.coalesce(
            func.sum(case((Job.state == RUNNING, Job.reserved_tokens), else_=0)), 0
        )
        stmt = select(
            Run.name,
            Dataset.name,
            Dataset.used_tokens,
            Dataset.reserved_tokens,
            select(settled)
            .select_from(Generation)
            .join(Job, Job.id == Generation.job_id)
            .where(Job.dataset_id == Dataset.id)
            .correlate(Dataset)
            .scalar_subquery(),
            select(reserved)
            .where(Job.dataset_id == Dataset.id)
            .correlate(Dataset)
            .scalar_subquery(),
        ).join(Run, Run.id == Dataset.run_id)
        problems = []
        for run, name, used, held, real_used, real_held in conn.execute(stmt):
            if used != real_used:
                problems.append(f"{run}/{name}: used_tokens {used} != {real_used} recorded")
            if held != real_held:
                problems.append(
                    f"{run}/{name}: reserved_tokens {held} != {real_held} held by running jobs"
                )
        return problems

    def max_overshoot(self) -> list[tuple[str, str, int]]:
        """(run, dataset, tokens used beyond the budget) for every dataset over budget."""
        stmt = (
            select(Run.name, Dataset.name, Dataset.used_tokens - Dataset.budget_tokens)
            .join(Run, Run.id == Dataset.run_id)
            .where(
                and_(
                    Dataset.budget_tokens.is_not(None), Dataset.used_tokens > Dataset.budget_tokens
                )
            )
        )
        with self.engine.connect() as conn:
            return [(r, d, int(o)) for r, d, o in conn.execute(stmt)]


_COUNTED = """
SELECT r.name, d.name, c.state, c.n, c.prompt, c.completion
FROM datasets d JOIN runs r ON r.id = d.run_id
JOIN (
    SELECT j.dataset_id, j.state, count(*) AS n,
        coalesce(sum(g.prompt_tokens), 0) AS prompt,
        coalesce(sum(g.completion_tokens), 0) AS completion
    FROM jobs j LEFT JOIN generations g ON g.job_id = j.id AND j.state = 'done'
    GROUP BY j.dataset_id, j.state
) c ON c.dataset_id = d.id
"""


def _counter_problems(conn: Connection) -> list[str]:
    """The datasets' counters (models.counters) against their jobs and generations."""
    real: dict[tuple[str, str], dict[str, int]] = {}
    for run, dataset, state, n, prompt, completion in conn.execute(text(_COUNTED)):
        figures = real.setdefault((run, dataset), {})
        figures[COUNTER_COLUMN[JobState(state)]] = int(n)
        if state == DONE:
            figures["done_prompt_tokens"] = int(prompt)
            figures["done_completion_tokens"] = int(completion)
    columns = [
        *COUNTER_COLUMN.values(),
        "done_prompt_tokens",
        "done_completion_tokens",
    ]
    stmt = select(Run.name, Dataset.name, *(getattr(Dataset, c) for c in columns)).join(
        Run, Run.id == Dataset.run_id
    )
    problems = []
    for run, dataset, *kept in conn.execute(stmt):
        figures = real.get((run, dataset), {})
        for column, value in zip(columns, kept, strict=True):
            if value != figures.get(column, 0):
                problems.append(
                    f"{run}/{dataset}: counter {column} is {value}, "
                    f"the jobs say {figures.get(column, 0)}"
                )
    return problems


# A conversation (c) with its jobs aggregated (t): numbered, distinct_turns, first_turn and
# last_turn count and bound the jobs that have a turn, unnumbered those that have none, done
# the done ones, latest the state of the highest turn.
_PER_CONVERSATION = """
SELECT c.id, c.dataset_id, c.state, c.turns, c.points, c.ended_reason,
    coalesce(t.jobs, 0) AS jobs, coalesce(t.numbered, 0) AS numbered,
    coalesce(t.distinct_turns, 0) AS distinct_turns, t.first_turn, t.last_turn,
    coalesce(t.done, 0) AS done, t.latest
FROM conversations c LEFT JOIN (
    SELECT conversation_id, count(*) AS jobs, count(turn) AS numbered,
        count(DISTINCT turn) AS distinct_turns, min(turn) AS first_turn,
        max(turn) AS last_turn, count(*) FILTER (WHERE state = 'done') AS done,
        (array_agg(state ORDER BY turn DESC) FILTER (WHERE turn IS NOT NULL))[1] AS latest
    FROM jobs WHERE conversation_id IS NOT NULL
    GROUP BY conversation_id
) t ON t.conversation_id = c.id
"""
_SETTLED = "('done', 'failed', 'skipped_budget')"
# Each check of a conversation: what one that fails it is, and the condition that finds it
# over _PER_CONVERSATION (docs/design.md §13 says why each holds).
_CONVERSATION_CHECKS: list[tuple[str, str]] = [
    (
        "whose jobs are not turns 0 to turns - 1 exactly (a turn missing or beyond its count)",
        "NOT (c.distinct_turns = c.turns AND c.numbered = c.jobs"
        " AND coalesce(c.first_turn, 0) = 0 AND coalesce(c.last_turn, -1) = c.turns - 1)",
    ),
    ("with two jobs for one turn", "c.distinct_turns < c.numbered"),
    ("with a job that has no turn", "c.numbered < c.jobs"),
    ("with more turns than answer points", "c.turns > c.points"),
    (
        "with a turn before its latest that is not done",
        "c.jobs - c.done > CASE WHEN c.latest = 'done' THEN 0 ELSE 1 END",
    ),
    (
        "active whose latest turn is not queued or running",
        "c.state = 'active' AND c.latest IS DISTINCT FROM 'queued'"
        " AND c.latest IS DISTINCT FROM 'running'",
    ),
    (
        "waiting whose latest turn is not settled",
        f"c.state = 'waiting' AND NOT coalesce(c.latest IN {_SETTLED}, false)",
    ),
    (
        "done before every answer point has its turn done",
        "c.state = 'done' AND NOT (c.turns = c.points AND c.done = c.jobs AND c.jobs > 0)",
    ),
    ("ended without a reason", "c.state = 'ended' AND c.ended_reason IS NULL"),
    (
        "ended whose latest turn is not settled as its reason says",
        "c.state = 'ended' AND c.latest IS DISTINCT FROM CASE c.ended_reason"
        " WHEN 'failed' THEN 'failed' WHEN 'budget' THEN 'skipped_budget' ELSE 'done' END",
    ),
    ("with an end reason but not ended", "c.state <> 'ended' AND c.ended_reason IS NOT NULL"),
]


def _conversation_problems(conn: Connection) -> list[str]:
    """Each conversation against its turns' jobs: one aggregate over the conversations'
    jobs, then one line per dataset and check, naming its first conversation that fails."""
    found = ", ".join(
        f"count(*) FILTER (WHERE {where}), min(c.id) FILTER (WHERE {where})"
        for _, where in _CONVERSATION_CHECKS
    )
    stmt = text(
        f"SELECT r.name, d.name, {found} FROM ({_PER_CONVERSATION}) c"
        " JOIN datasets d ON d.id = c.dataset_id JOIN runs r ON r.id = d.run_id"
        " GROUP BY r.name, d.name ORDER BY r.name, d.name"
    )
    problems = []
    for run, dataset, *figures in conn.execute(stmt):
        for (what, _), n, first in zip(
            _CONVERSATION_CHECKS, figures[::2], figures[1::2], strict=True
        ):
            if n:
                problems.append(
                    f"{run}/{dataset}: {n} conversation(s) {what} (first: conversation {first})"
                )
    return problems
