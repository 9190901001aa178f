"""The two transactions of every job attempt: the claim and the record.

They are written in SQL and run on the pooled connection's psycopg connection
(``models.db.driver_cursor``), not through SQLAlchemy's execution layer: at a few
statements a job, that layer cost the worker more CPU than anything else it does per job,
and a worker process is bound to one core (BENCHMARKS.md, "Orchestration ceiling"). Every
other query stays in SQLAlchemy; these are kept equal to the tables by the tests that run
them against a migrated database.
"""

from __future__ import annotations

from typing import Any

from psycopg import Cursor
from psycopg.types.json import Jsonb
from sqlalchemy import Engine

from core.samples import request_params, variants_of
from models.counters import moved_sql, recorded_sql
from models.db import driver_cursor
from models.ledger import (
    OBSERVED_SAMPLE,
    BudgetBasis,
    ReservePolicy,
    estimate_due,
    observed_completion,
    reservation,
    settled,
)
from models.records import Claim, ClaimedJob, GenerationRecord
from models.schema import stored_prompt
from models.states import JobState
from models.tokens import pack, unpack

QUEUED, RUNNING = JobState.QUEUED, JobState.RUNNING

# Win the job if it is still queued, and read its dataset's and run's facts in the same
# statement (UPDATE ... FROM reads those rows without locking them).
_TAKE = f"""
UPDATE jobs SET state = 'running', attempts = jobs.attempts + 1, worker = %(worker)s,
       lease_until = now() + make_interval(secs => %(lease)s), updated_at = now()
FROM datasets, runs
WHERE jobs.id = %(job)s AND jobs.state = 'queued'
  AND datasets.id = jobs.dataset_id AND runs.id = datasets.run_id
RETURNING jobs.id, jobs.dataset_id, {stored_prompt("input_ids")} AS input_ids,
          jobs.prompt_tokens, jobs.attempts, jobs.variant, jobs.sampling_seed,
          jobs.opens_reasoning, datasets.sampling_params, datasets.variants, datasets.budget_basis,
          datasets.reserve, datasets.observed_reserve_tokens,
          datasets.name AS dataset, runs.name AS run, runs.think_end_id, runs.vocab_size,
          runs.model_name, runs.tokenizer_path
"""

# The ledger rule of docs/design.md §4, one conditional UPDATE of the dataset per branch (see
# `claim`), which also counts the job as running; only when it reserved does the job
# record what it holds, in the same statement.
_RESERVE = f"""
WITH reserved AS (
    UPDATE datasets SET reserved_tokens = reserved_tokens + %(need)s,
           {moved_sql(QUEUED, RUNNING)}
    WHERE id = %(dataset)s AND {{condition}}
    RETURNING id
)
UPDATE jobs SET reserved_tokens = %(need)s FROM reserved
WHERE jobs.id = %(job)s
RETURNING jobs.id
"""
# The reservation fits next to what is settled and held (or there is no budget).
_RESERVE_IF_FITS = _RESERVE.format(
    condition="(budget_tokens IS NULL OR used_tokens + reserved_tokens + %(need)s <= budget_tokens)"
)
# Nothing is held and the budget is not spent: run even a job larger than the rest.
_RESERVE_IF_NOTHING_HELD = _RESERVE.format(
    condition="reserved_tokens = 0 AND used_tokens < budget_tokens"
)
_SKIP = """
UPDATE jobs SET state = 'skipped_budget', attempts = attempts - 1, worker = NULL,
       lease_until = NULL, reserved_tokens = 0
WHERE id = %(job)s
"""
# Counted as skipped only if settled usage reached the budget: the check and the count are
# one statement, so a concurrent `budget set` (which locks the row) waits for this skip and
# its re-queue then covers it.
_SKIP_IF_SPENT = f"""
UPDATE datasets SET {moved_sql(QUEUED, JobState.SKIPPED_BUDGET)}
WHERE id = %(dataset)s AND used_tokens >= budget_tokens
RETURNING id
"""

# Mark the job done if this worker still holds it. The subquery locks the row and reads
# what it reserved before this UPDATE zeroes it (RETURNING shows only new values).
_DONE = """
UPDATE jobs SET state = 'done', reserved_tokens = 0, lease_until = NULL, last_error = NULL,
       updated_at = now(), finished_at = now()
FROM (SELECT id, reserved_tokens FROM jobs
      WHERE id = %(job)s AND state = 'running' AND worker = %(worker)s
      FOR UPDATE) AS held,
     datasets
WHERE jobs.id = held.id AND datasets.id = jobs.dataset_id
RETURNING jobs.dataset_id, held.reserved_tokens, datasets.budget_basis, datasets.reserve,
          datasets.budget_tokens, datasets.jobs_done,
          (datasets.sampling_params ->> 'max_new_tokens')::integer AS max_new_tokens
"""
_INSERT_GENERATION = """
INSERT INTO generations (job_id, dataset_id, output_ids, finish_type, finish_matched,
    prompt_tokens, completion_tokens, cached_tokens, e2e_latency, server, meta_info,
    think_end_present, reasoning_tokens, answer_tokens)
VALUES (%(job)s, %(dataset)s, %(output_ids)s, %(finish_type)s, %(finish_matched)s,
    %(prompt_tokens)s, %(completion_tokens)s, %(cached_tokens)s, %(e2e_latency)s,
    %(server)s, %(meta_info)s, %(think_end_present)s, %(reasoning_tokens)s,
    %(answer_tokens)s)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id
"""
_SETTLE_DONE = f"""
UPDATE datasets SET used_tokens = used_tokens + %(used)s,
       reserved_tokens = reserved_tokens - %(reserved)s,
       {moved_sql(RUNNING, JobState.DONE)}, {recorded_sql("prompt", "completion")}{{estimate}}
WHERE id = %(dataset)s
"""
_SETTLE = _SETTLE_DONE.format(estimate="")
# Every OBSERVED_REFRESH_EVERY done jobs, the same statement also stores the dataset's new
# estimate: the hot row is written by one statement either way.
_SETTLE_ESTIMATED = _SETTLE_DONE.format(estimate=", observed_reserve_tokens = %(estimate)s")
# The dataset's latest completion lengths, for its estimate. The inner scan reads the
# newest generations by the time index and stops after OBSERVED_SAMPLE of this dataset, or
# after `scan` generations of any: its cost stays bounded when other datasets record far
# more (generations has no index on dataset_id, and the record adds none).
_RECENT_COMPLETIONS = """
SELECT completion_tokens FROM (
    SELECT dataset_id, completion_tokens FROM generations ORDER BY created_at DESC LIMIT %(scan)s
) AS recent
WHERE dataset_id = %(dataset)s
LIMIT %(sample)s
"""
# The newest generations the estimate looks through (of every dataset).
_ESTIMATE_SCAN = 10 * OBSERVED_SAMPLE


class Rollback(Exception):
    """Raised inside a transaction to undo it and report an outcome."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def claim(engine: Engine, job_id: int, worker: str, lease_seconds: int) -> Claim:
    """Win a queued job for ``worker`` and hold its reservation in the budget ledger.

    A job reserves its worst case, or under the dataset's "observed" policy the estimate
    stored on the dataset when it is smaller (models.ledger.reservation). It runs when that
    fits next to what is settled and held. When it does not fit but nothing is held, it
    runs anyway while settled usage is below the budget (else a job larger than the
    remainder would wait forever). Otherwise it is deferred while reservations are held,
    and skipped once settled usage reached the budget. The overshoot this allows is
    docs/design.md §4's bound (models.ledger.overshoot_bound).
    """
    try:
        with engine.begin() as conn, driver_cursor(conn) as cursor:
            return _claim(cursor, job_id, worker, lease_seconds)
    except Rollback as rollback:
        return Claim(rollback.outcome)


def _claim(cursor: Cursor[Any], job_id: int, worker: str, lease_seconds: int) -> Claim:
    taken = {"job": job_id, "worker": worker, "lease": lease_seconds}
    job = cursor.execute(_TAKE, taken).fetchone()
    if job is None:
        raise Rollback("not_queued")
    params = request_params(
        job.sampling_params or {}, variants_of(job.variants), job.variant, job.sampling_seed
    )
    max_new = int(params.get("max_new_tokens", 0))
    # The estimate was read with the dataset row, unlocked: one refreshed meanwhile only
    # changes what this job holds, which the job records and its settle gives back exactly.
    observed = job.observed_reserve_tokens if job.reserve == ReservePolicy.OBSERVED else None
    need = reservation(job.prompt_tokens, max_new, BudgetBasis(job.budget_basis), observed)
    # The dataset row is every worker's hot spot: touch it only with the last statement
    # before COMMIT, and only in single conditional UPDATEs (never a lock held across round
    # trips). Each branch of the ledger rule is one atomic predicate, or a fact that only
    # grows (used), so no decision needs a lock.
    ledger = {"job": job_id, "dataset": job.dataset_id, "need": need}
    if not _one(cursor, _RESERVE_IF_FITS, ledger) and not _one(
        cursor, _RESERVE_IF_NOTHING_HELD, ledger
    ):
        cursor.execute(_SKIP, {"job": job_id})
        if not _one(cursor, _SKIP_IF_SPENT, ledger):
            raise Rollback("deferred")  # undoes the skip above
        return Claim("skipped")
    return Claim(
        "claimed",
        ClaimedJob(
            id=job.id,
            dataset_id=job.dataset_id,
            input_ids=unpack(job.input_ids),
            sampling_params=params,
            attempts=job.attempts,
            reserved_tokens=need,
            think_end_id=job.think_end_id if job.opens_reasoning else None,
            vocab_size=job.vocab_size,
            run=job.run,
            dataset=job.dataset,
            model=job.model_name,
            tokenizer_path=job.tokenizer_path,
        ),
    )


def record(engine: Engine, job_id: int, worker: str, gen: GenerationRecord) -> bool:
    """Store the generation, settle the ledger, mark done: atomically; False if not ours."""
    try:
        with engine.begin() as conn, driver_cursor(conn) as cursor:
            job = cursor.execute(_DONE, {"job": job_id, "worker": worker}).fetchone()
            if job is None:
                return False
            row = {"job": job_id, "dataset": job.dataset_id, **_generation_params(gen)}
            if not _one(cursor, _INSERT_GENERATION, row):
                raise Rollback("already_recorded")  # never while the claim holds
            basis = BudgetBasis(job.budget_basis)
            settle = {
                "dataset": job.dataset_id,
                "used": settled(gen.prompt_tokens, gen.completion_tokens, basis),
                "reserved": job.reserved_tokens,
                "prompt": gen.prompt_tokens,
                "completion": gen.completion_tokens,
                "estimate": _estimate(cursor, job),
            }
            statement = _SETTLE if settle["estimate"] is None else _SETTLE_ESTIMATED
            cursor.execute(statement, settle)  # the hot dataset row last, as in the claim
    except Rollback:
        return False
    return True


def _estimate(cursor: Cursor[Any], job: Any) -> int | None:
    """The dataset's new observed estimate when this record is due to refresh it, else None.

    Due by the count of done jobs read with the dataset row, unlocked: two records racing
    may both refresh, or both pass a due count; either way the next due count refreshes it.
    Only a budgeted dataset under "observed" reads its lengths: the others reserve nothing
    that matters, or the worst case.
    """
    if job.reserve != ReservePolicy.OBSERVED or job.budget_tokens is None:
        return None
    if not estimate_due(job.jobs_done + 1) or job.max_new_tokens is None:
        return None
    lengths = cursor.execute(
        _RECENT_COMPLETIONS,
        {"dataset": job.dataset_id, "scan": _ESTIMATE_SCAN, "sample": OBSERVED_SAMPLE},
    ).fetchall()
    return observed_completion([row[0] for row in lengths], int(job.max_new_tokens))


def _one(cursor: Cursor[Any], sql: str, params: dict[str, Any]) -> bool:
    """Run a statement with RETURNING; whether it returned a row."""
    return cursor.execute(sql, params).fetchone() is not None


def _generation_params(gen: GenerationRecord) -> dict[str, Any]:
    """A generation row's values as psycopg takes them (ids packed, JSON wrapped)."""
    return {
        "output_ids": pack(gen.output_ids),
        "finish_type": gen.finish_type,
        "finish_matched": Jsonb(gen.finish_matched),
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": gen.e2e_latency,
        "server": gen.server,
        "meta_info": Jsonb(gen.meta_info),
        "think_end_present": gen.think_end_present,
        "reasoning_tokens": gen.reasoning_tokens,
        "answer_tokens": gen.answer_tokens,
    }
