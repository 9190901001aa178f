"""What every job attempt does to Postgres: the claim and the record.

Each is one atomic statement in autocommit (the claim reads the job's facts first, the
record refreshes an estimate now and then), so no row lock is held across a round trip:
with a transaction of several statements, the dataset's row, which every claim and record
of the dataset updates, stayed locked while the client, one of a worker's busy threads,
got the GIL back to send COMMIT, and the other threads' statements queued behind it
(BENCHMARKS.md, "The claim and the record as one statement each").

They are written in SQL and run on the pooled connection's psycopg connection
(``models.db.autocommit_cursor``), not through SQLAlchemy's execution layer: at a few
statements a job, that layer cost the worker more CPU than anything else it does per job,
and a worker process is bound to one core. Every other query stays in SQLAlchemy; these
are kept equal to the tables by the tests that run them against a migrated database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import AsyncConnection, Cursor
from psycopg.errors import UniqueViolation
from psycopg.types.json import Jsonb
from sqlalchemy import Engine

from core.samples import request_params, variants_of
from models.counters import moved_sql, recorded_sql
from models.db import autocommit_cursor
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

# What a claim needs to know before it takes a job: the job's and its dataset's and run's
# facts, read without a lock (they do not change while the job is queued, but for the
# dataset's observed estimate, which only changes what the job holds: see `_need`). The
# prompt's ids come with the take, only to the worker that wins the job.
_FACTS_OF = """
SELECT jobs.id, jobs.dataset_id, jobs.prompt_tokens, jobs.variant, jobs.sampling_seed,
       jobs.opens_reasoning,
       datasets.sampling_params, datasets.variants, datasets.budget_basis,
       datasets.reserve, datasets.observed_reserve_tokens,
       datasets.name AS dataset, runs.name AS run, runs.think_end_id, runs.vocab_size,
       runs.model_name, runs.tokenizer_path
FROM jobs JOIN datasets ON datasets.id = jobs.dataset_id JOIN runs ON runs.id = datasets.run_id
WHERE jobs.state = 'queued' AND """
_FACTS = _FACTS_OF + "jobs.id = %(job)s"

# Lock the job's row if it is still queued (the first CTE of the take and the skip): a
# job another worker took meanwhile drops out, after waiting for that worker's statement.
_LOCK_QUEUED = """
    SELECT id, dataset_id FROM jobs WHERE id = %(job)s AND state = 'queued' FOR UPDATE
"""

# Take the job if it is still queued and its reservation fits the ledger rule of
# docs/design.md §4, all in one statement: `queued` locks the job's row (and drops it if
# another worker took it meanwhile), `reserved` holds the tokens in the dataset's row and
# counts the job as running, and the job is taken only if both did. The rule's two branches
# are one predicate: the reservation fits next to what is settled and held (or there is no
# budget); or nothing is held and the budget is not spent, so that even a job larger than
# the rest runs. Locks are taken in the record's order, the job's row before the dataset's.
_TAKE = f"""
WITH queued AS ({_LOCK_QUEUED}), reserved AS (
    UPDATE datasets SET reserved_tokens = reserved_tokens + %(need)s,
           {moved_sql(QUEUED, RUNNING)}
    FROM queued
    WHERE datasets.id = queued.dataset_id
      AND (budget_tokens IS NULL OR used_tokens + reserved_tokens + %(need)s <= budget_tokens
           OR (reserved_tokens = 0 AND used_tokens < budget_tokens))
    RETURNING datasets.id
), taken AS (
    UPDATE jobs SET state = 'running', attempts = jobs.attempts + 1, worker = %(worker)s,
           lease_until = now() + make_interval(secs => %(lease)s), updated_at = now(),
           reserved_tokens = %(need)s
    FROM queued, reserved
    WHERE jobs.id = queued.id
    RETURNING jobs.attempts, {stored_prompt("input_ids")} AS input_ids
)
SELECT EXISTS (SELECT FROM queued) AS queued, (SELECT attempts FROM taken) AS attempts,
       (SELECT input_ids FROM taken) AS input_ids
"""

# A job whose reservation did not fit is skipped if settled usage reached the budget (the
# check and the count in one statement, so a concurrent `budget set`, which locks the
# dataset's row, waits for this skip and its re-queue then covers it), else left queued:
# deferred while reservations are held.
_SKIP_IF_SPENT = f"""
WITH queued AS ({_LOCK_QUEUED}), spent AS (
    UPDATE datasets SET {moved_sql(QUEUED, JobState.SKIPPED_BUDGET)}
    FROM queued
    WHERE datasets.id = queued.dataset_id AND used_tokens >= budget_tokens
    RETURNING datasets.id
)
UPDATE jobs SET state = 'skipped_budget', worker = NULL, lease_until = NULL, reserved_tokens = 0
FROM queued, spent
WHERE jobs.id = queued.id
RETURNING jobs.id
"""

# Store the generation, mark the job done and settle the ledger, in one statement, if this
# worker still holds the job: `held` locks its row and reads what it reserved before `done`
# zeroes it (RETURNING shows only new values); the dataset's row, every worker's hot spot,
# is written last. A generation already stored (never while the claim holds) fails the
# insert, and with it the whole statement.
_RECORD = f"""
WITH held AS (
    SELECT id, dataset_id, reserved_tokens FROM jobs
    WHERE id = %(job)s AND state = 'running' AND worker = %(worker)s
    FOR UPDATE
), done AS (
    UPDATE jobs SET state = 'done', reserved_tokens = 0, lease_until = NULL, last_error = NULL,
           updated_at = now(), finished_at = now()
    FROM held
    WHERE jobs.id = held.id
    RETURNING held.id, held.dataset_id, held.reserved_tokens
), stored AS (
    INSERT INTO generations (job_id, dataset_id, output_ids, finish_type, finish_matched,
        prompt_tokens, completion_tokens, cached_tokens, e2e_latency, server, meta_info,
        think_end_present, reasoning_tokens, answer_tokens)
    SELECT id, dataset_id, %(output_ids)s, %(finish_type)s, %(finish_matched)s,
        %(prompt_tokens)s, %(completion_tokens)s, %(cached_tokens)s, %(e2e_latency)s,
        %(server)s, %(meta_info)s, %(think_end_present)s, %(reasoning_tokens)s,
        %(answer_tokens)s
    FROM done
    RETURNING job_id
)
UPDATE datasets SET
       used_tokens = used_tokens + CASE WHEN budget_basis = '{BudgetBasis.TOTAL.value}'
                                        THEN %(used_total)s ELSE %(used_completion)s END,
       reserved_tokens = datasets.reserved_tokens - done.reserved_tokens,
       {moved_sql(RUNNING, JobState.DONE)}, {recorded_sql("prompt_tokens", "completion_tokens")}
FROM done, stored
WHERE datasets.id = done.dataset_id
RETURNING datasets.id, datasets.reserve, datasets.budget_tokens, datasets.jobs_done,
          (datasets.sampling_params ->> 'max_new_tokens')::integer AS max_new_tokens
"""
# Every OBSERVED_REFRESH_EVERY done jobs, a record also stores the dataset's new estimate.
_STORE_ESTIMATE = (
    "UPDATE datasets SET observed_reserve_tokens = %(estimate)s WHERE id = %(dataset)s"
)
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


def claim(engine: Engine, job_id: int, worker: str, lease_seconds: int) -> Claim:
    """Win a queued job for ``worker`` and hold its reservation in the budget ledger.

    A job reserves its worst case, or under the dataset's "observed" policy the estimate
    stored on the dataset when it is smaller (models.ledger.reservation). It runs when that
    fits next to what is settled and held. When it does not fit but nothing is held, it
    runs anyway while settled usage is below the budget (else a job larger than the
    remainder would wait forever). Otherwise it is deferred while reservations are held,
    and skipped once settled usage reached the budget. The overshoot this allows is
    docs/design.md §4's bound (models.ledger.overshoot_bound).

    Each statement commits alone (`autocommit_cursor`): the one that takes the job is
    atomic, and the read before it takes nothing.
    """
    with autocommit_cursor(engine) as cursor:
        facts = cursor.execute(_FACTS, {"job": job_id}).fetchone()
        if facts is None:
            return Claim("not_queued")
        params = _params(facts)
        need = _need(facts, params)
        taken = {"job": job_id, "worker": worker, "lease": lease_seconds, "need": need}
        take = cursor.execute(_TAKE, taken).fetchone()
        assert take is not None, "a SELECT without FROM returns one row"
        if not take.queued:
            return Claim("not_queued")
        if take.attempts is None:
            skipped = _one(cursor, _SKIP_IF_SPENT, {"job": job_id})
            return Claim("skipped" if skipped else "deferred")
    return Claim("claimed", _claimed(facts, params, take, need))


def _params(facts: Any) -> dict[str, Any]:
    """The sampling params the job's request sends."""
    variants = variants_of(facts.variants)
    return request_params(facts.sampling_params or {}, variants, facts.variant, facts.sampling_seed)


def _need(facts: Any, params: dict[str, Any]) -> int:
    """What the job reserves. The estimate was read with the dataset's row, unlocked: one
    refreshed meanwhile only changes what this job holds, which the job records and its
    settle gives back exactly."""
    max_new = int(params.get("max_new_tokens", 0))
    observed = facts.observed_reserve_tokens if facts.reserve == ReservePolicy.OBSERVED else None
    return reservation(facts.prompt_tokens, max_new, BudgetBasis(facts.budget_basis), observed)


def _claimed(facts: Any, params: dict[str, Any], take: Any, need: int) -> ClaimedJob:
    return ClaimedJob(
        id=facts.id,
        dataset_id=facts.dataset_id,
        input_ids=unpack(take.input_ids),
        sampling_params=params,
        attempts=take.attempts,
        reserved_tokens=need,
        think_end_id=facts.think_end_id if facts.opens_reasoning else None,
        vocab_size=facts.vocab_size,
        run=facts.run,
        dataset=facts.dataset,
        model=facts.model_name,
        tokenizer_path=facts.tokenizer_path,
    )


def record(engine: Engine, job_id: int, worker: str, gen: GenerationRecord) -> bool:
    """Store the generation, settle the ledger, mark done: atomically, in one statement;
    False if not ours (or, never while the claim holds, already recorded)."""
    with autocommit_cursor(engine) as cursor:
        try:
            dataset = cursor.execute(_RECORD, _record_params(job_id, gen, worker)).fetchone()
        except UniqueViolation:
            return False
        if dataset is None:
            return False
        estimate = _estimate(cursor, dataset)
        if estimate is not None:
            cursor.execute(_STORE_ESTIMATE, {"dataset": dataset.id, "estimate": estimate})
    return True


def _estimate(cursor: Cursor[Any], dataset: Any) -> int | None:
    """The dataset's new observed estimate when this record is due to refresh it, else None.

    Due by the count of done jobs that this record's statement left: the statement counts
    the job under the dataset row's lock and returns the new count, so each count reaches
    one record and each due count refreshes once (or not at all if that record's refresh
    fails; the next due count catches up). Only a budgeted dataset under "observed" reads
    its lengths: the others reserve nothing that matters, or the worst case.
    """
    if not _estimate_due(dataset):
        return None
    lengths = cursor.execute(
        _RECENT_COMPLETIONS,
        {"dataset": dataset.id, "scan": _ESTIMATE_SCAN, "sample": OBSERVED_SAMPLE},
    ).fetchall()
    return observed_completion([row[0] for row in lengths], int(dataset.max_new_tokens))


def _estimate_due(dataset: Any) -> bool:
    return (
        dataset.reserve == ReservePolicy.OBSERVED
        and dataset.budget_tokens is not None
        and dataset.max_new_tokens is not None
        and estimate_due(dataset.jobs_done)
    )


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


# Batches, for a path that drives many requests from one event loop (bench.loop_path, the
# measure of docs/design.md §7's batched worker): the same statements, sent many at a time
# in one pipeline, so that a batch costs one round trip and one commit instead of one each.
# A pipeline's statements run as one implicit transaction (up to its Sync), each seeing the
# ones before it as the single statements see each other one after the other: the ledger
# rule holds job by job. Their locks last until the batch ends (on the server, with no
# round trip inside), so they are taken in the single statements' order, the job's row
# before its dataset's: the batch's first statement locks all its jobs' rows (by id), and
# only then do its statements lock their datasets' rows (by dataset id). Taken job by job
# (a job, its dataset, the next job), a batch holding a dataset's row would wait for a job
# that a single claim of it (a duplicate message) holds while waiting for that dataset's
# row: a deadlock, which Postgres breaks by failing one side after a second. An error
# aborts the whole batch; its jobs are then tried one at a time, so one bad row costs only
# itself.
_LOCK_JOBS = "SELECT id FROM jobs WHERE id = ANY(%(jobs)s) ORDER BY id FOR UPDATE"


async def claim_batch(
    conn: AsyncConnection[Any], job_ids: Sequence[int], worker: str, lease_seconds: int
) -> list[Claim]:
    """`claim` for each of ``job_ids`` (in that order) on ``conn`` (autocommit, rows as
    named tuples), in two round trips: the jobs' facts in one statement, the takes in one
    pipeline. A job that did not fit is deferred or skipped as `claim` does, alone; an id
    asked again is not_queued, as a second claim of a job is."""
    found = await conn.execute(_FACTS_OF + "jobs.id = ANY(%(jobs)s)", {"jobs": list(job_ids)})
    facts = sorted(await found.fetchall(), key=lambda f: (f.dataset_id, f.id))
    params = [_params(f) for f in facts]
    needs = [_need(f, p) for f, p in zip(facts, params, strict=True)]
    values = [
        {"job": f.id, "worker": worker, "lease": lease_seconds, "need": need}
        for f, need in zip(facts, needs, strict=True)
    ]
    try:
        takes = await _pipelined(conn, _TAKE, values)
    except psycopg.Error:
        if len(job_ids) == 1:
            raise
        return [c for j in job_ids for c in await claim_batch(conn, [j], worker, lease_seconds)]
    claims = {}
    for fact, param, need, take in zip(facts, params, needs, takes, strict=True):
        if not take.queued:
            continue  # taken meanwhile: not_queued
        if take.attempts is not None:
            claims[fact.id] = Claim("claimed", _claimed(fact, param, take, need))
        else:
            skipped = await (await conn.execute(_SKIP_IF_SPENT, {"job": fact.id})).fetchone()
            claims[fact.id] = Claim("skipped" if skipped else "deferred")
    # An id asked twice (two messages of one job in a batch) is won once.
    return [claims.pop(j, Claim("not_queued")) for j in job_ids]


async def record_batch(
    conn: AsyncConnection[Any], worker: str, done: Sequence[tuple[ClaimedJob, GenerationRecord]]
) -> list[bool]:
    """`record` for each of ``done`` (in that order) on ``conn``, in one pipeline: whether
    each was stored (False: the claim was lost, or a generation was already stored)."""
    order = sorted(range(len(done)), key=lambda i: (done[i][0].dataset_id, done[i][0].id))
    try:
        values = [_record_params(done[i][0].id, done[i][1], worker) for i in order]
        rows = await _pipelined(conn, _RECORD, values)
    except UniqueViolation:
        if len(done) == 1:
            return [False]
        return [ok for one in done for ok in await record_batch(conn, worker, [one])]
    stored = [False] * len(done)
    for i, dataset in zip(order, rows, strict=True):
        stored[i] = dataset is not None
        if dataset is not None and _estimate_due(dataset):
            await _refresh_estimate(conn, dataset)
    return stored


def _record_params(job_id: int, gen: GenerationRecord, worker: str) -> dict[str, Any]:
    """The record's values: whose job, what it used under either basis, the generation."""
    return {
        "job": job_id,
        "worker": worker,
        "used_total": settled(gen.prompt_tokens, gen.completion_tokens, BudgetBasis.TOTAL),
        "used_completion": settled(
            gen.prompt_tokens, gen.completion_tokens, BudgetBasis.COMPLETION
        ),
        **_generation_params(gen),
    }


async def _pipelined(
    conn: AsyncConnection[Any], sql: str, params: list[dict[str, Any]]
) -> list[Any]:
    """Run ``sql`` once per params (each naming its job) in one pipeline, one transaction,
    after locking the jobs' rows; each one's first row (None for none)."""
    cursors = []
    async with conn.pipeline():
        await conn.execute(_LOCK_JOBS, {"jobs": [each["job"] for each in params]})
        for each in params:
            cursor = conn.cursor()
            await cursor.execute(sql, each)
            cursors.append(cursor)
    return [await cursor.fetchone() for cursor in cursors]


async def _refresh_estimate(conn: AsyncConnection[Any], dataset: Any) -> None:
    """Store the dataset's new observed estimate (its record made it due: `_estimate`)."""
    scan = {"dataset": dataset.id, "scan": _ESTIMATE_SCAN, "sample": OBSERVED_SAMPLE}
    lengths = await (await conn.execute(_RECENT_COMPLETIONS, scan)).fetchall()
    estimate = observed_completion([row[0] for row in lengths], int(dataset.max_new_tokens))
    if estimate is not None:
        await conn.execute(_STORE_ESTIMATE, {"dataset": dataset.id, "estimate": estimate})
