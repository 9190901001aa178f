"""The repository: every query eaglegen runs, called by name."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any

import psycopg
from sqlalchemy import Engine, and_, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from models.audit import AuditQueries
from models.budgets import BudgetQueries
from models.conversations import ConversationQueries, dataset_order_seed
from models.counters import moved
from models.db import driver_cursor
from models.export import ExportQueries
from models.feed import FeedQueries
from models.jobs import JobQueries
from models.ledger import ReservePolicy
from models.order import new_seed, sort_key
from models.plan import PlanQueries
from models.records import (
    DatasetSpec,
    JobBatch,
    NewJob,
    Rejection,
    RunSpec,
    SampleColumns,
)
from models.rejected import RejectedQueries
from models.schema import Dataset, Generation, Job, RejectedRow, Run
from models.snapshot import DatasetCounts
from models.states import JobState
from models.status import StatusQueries


class RunMismatchError(ValueError):
    """The run exists with a different tokenizer or chat template."""


class DatasetMismatchError(ValueError):
    """The dataset exists with different sampling params."""


# New jobs are copied (binary COPY) into a per-session staging table, then inserted from it
# in one statement that skips prompts the dataset already has. COPY cannot skip conflicts
# itself, and an INSERT taking the rows as array parameters spent more client CPU escaping
# them than the whole COPY takes. Where the caller expects every job to be new, they are
# copied straight into `jobs` with ids drawn beforehand (a fifth less server CPU); one that
# exists after all fails that COPY, and the batch goes through the staging table instead.
#
# Samples of a prompt (core.samples) are staged with their sample columns and inserted one
# sample index at a time, lowest first: a job names jobs of lower samples (its sample 0, the
# holder of its prompt ids) by identity, found by the unique key once an earlier statement
# or enqueue inserted them. A sample whose ids another holds stores NULL ids and messages.
# A batch of plain jobs is all sample 0 and names nothing: one statement.
_CREATE_STAGE = """
    CREATE TEMP TABLE IF NOT EXISTS job_stage (
        row_index integer, prompt_sha256 bytea, input_ids bytea, prompt_tokens integer,
        messages text, opens_reasoning boolean, sort_key bigint, sample integer,
        variant text, sampling_seed bigint, first_sha bytea, holder_sha bytea
    ) ON COMMIT DELETE ROWS
"""
_COPY_STAGE = "COPY job_stage FROM STDIN (FORMAT BINARY)"
_KEYED_TYPES = ("integer", "bytea", "bytea", "integer", "text", "bool", "bigint")
_STAGE_TYPES = (*_KEYED_TYPES, "integer", "text", "bigint", "bytea", "bytea")
_NEW_IDS = "SELECT nextval(pg_get_serial_sequence('jobs', 'id')) FROM generate_series(1, %s)"
_COPY_JOBS = (
    "COPY jobs (id, dataset_id, row_index, prompt_sha256, input_ids, prompt_tokens, messages,"
    " opens_reasoning, sort_key) FROM STDIN (FORMAT BINARY)"
)
# The messages are JSON text already, and json's binary form is its text.
_JOB_TYPES = ("bigint", "bigint", *_KEYED_TYPES)
# Jobs named by identity are looked up one by one (a subquery per row, by the unique index),
# and only for the rows that name one: a plain batch does no lookup at all.
_BY_IDENTITY = (
    "CASE WHEN s.{column} IS NOT NULL THEN (SELECT j.id FROM jobs j"
    " WHERE j.dataset_id = %(dataset)s AND j.prompt_sha256 = s.{column}) END"
)
_INSERT_STAGED = f"""
    INSERT INTO jobs (
        dataset_id, row_index, prompt_sha256, input_ids, prompt_tokens, messages, opens_reasoning,
        sort_key, sample, variant, sampling_seed, prompt_job, prompt_of
    )
    SELECT %(dataset)s, row_index, prompt_sha256,
        CASE WHEN holder_sha IS NULL THEN input_ids END, prompt_tokens,
        CASE WHEN holder_sha IS NULL THEN messages::json END, opens_reasoning,
        sort_key, sample, variant, sampling_seed, first_id, holder_id
    FROM (
        SELECT s.*, {_BY_IDENTITY.format(column="first_sha")} AS first_id,
            {_BY_IDENTITY.format(column="holder_sha")} AS holder_id
        FROM job_stage s WHERE s.sample = %(sample)s
    ) staged
    WHERE holder_sha IS NULL OR holder_id IS NOT NULL
    ORDER BY row_index
    ON CONFLICT (dataset_id, prompt_sha256) DO NOTHING
    RETURNING id
"""
# The sample columns of a plain job.
_PLAIN = SampleColumns(0, None, None)


def _keyed_rows(batch: JobBatch, seed: int) -> Iterator[tuple[Any, ...]]:
    """The batch's rows, each with its sort key (models.order) appended: every sample of a
    prompt takes its sample 0's place, so a budget that stops the dataset stops it between
    prompts, each with all its samples."""
    columns = batch.samples or itertools.repeat(_PLAIN)
    for row, sample in zip(batch.rows(), columns, strict=False):
        yield (*row, sort_key(seed, sample.first or row[1]))


def _copy_new_jobs(
    cursor: psycopg.Cursor[Any], dataset_id: int, batch: JobBatch, seed: int
) -> list[int] | None:
    """COPY the batch straight into `jobs`; None (and nothing written) if one exists."""
    cursor.execute("SAVEPOINT new_jobs")
    try:
        cursor.execute(_NEW_IDS, (len(batch),))
        ids = sorted(int(r[0]) for r in cursor.fetchall())
        with cursor.copy(_COPY_JOBS) as copy:
            copy.set_types(_JOB_TYPES)
            in_row_order = sorted(_keyed_rows(batch, seed), key=itemgetter(0))  # as ids ascend
            for job_id, row in zip(ids, in_row_order, strict=True):
                copy.write_row((job_id, dataset_id, *row))
    except psycopg.errors.UniqueViolation:
        cursor.execute("ROLLBACK TO SAVEPOINT new_jobs")
        return None
    cursor.execute("RELEASE SAVEPOINT new_jobs")
    return ids


def _insert_staged(
    cursor: psycopg.Cursor[Any], dataset_id: int, batch: JobBatch, seed: int
) -> list[int]:
    """Stage the batch, then insert what the dataset lacks, sample index by sample index:
    the ids of those."""
    cursor.execute(_CREATE_STAGE)
    columns = batch.samples or [_PLAIN] * len(batch)
    with cursor.copy(_COPY_STAGE) as copy:
        copy.set_types(_STAGE_TYPES)
        for row, c in zip(_keyed_rows(batch, seed), columns, strict=True):
            copy.write_row((*row, c.sample, c.variant, c.sampling_seed, c.first, c.holder))
    ids: list[int] = []
    for sample in sorted({c.sample for c in columns}):
        cursor.execute(_INSERT_STAGED, {"dataset": dataset_id, "sample": sample})
        ids += [int(r[0]) for r in cursor.fetchall()]
    return ids


class Repository(
    JobQueries,
    ConversationQueries,
    FeedQueries,
    BudgetQueries,
    AuditQueries,
    ExportQueries,
    StatusQueries,
    PlanQueries,
    RejectedQueries,
):
    """All SQL behind named methods; one instance per process, shared by threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # --- runs and datasets -------------------------------------------------------------

    def ensure_run(self, spec: RunSpec) -> int:
        """The run's id, creating it; refuse a different tokenizer or template."""
        with self.engine.begin() as conn:
            conn.execute(
                pg_insert(Run)
                .values(
                    name=spec.name,
                    tokenizer_path=spec.tokenizer_path,
                    tokenizer_sha256=spec.tokenizer_sha256,
                    chat_template_sha256=spec.chat_template_sha256,
                    model_name=spec.model_name,
                    chat_template_kwargs=spec.chat_template_kwargs,
                    max_context_len=spec.max_context_len,
                    package_versions=spec.package_versions,
                    think_end_id=spec.think_end_id,
                    vocab_size=spec.vocab_size,
                    order_seed=new_seed() if spec.order_seed is None else spec.order_seed,
                    family=spec.family,
                    trust_remote_code=spec.trust_remote_code,
                )
                .on_conflict_do_nothing(index_elements=[Run.name])
            )
            if spec.trust_remote_code:  # consent given later counts too
                conn.execute(
                    update(Run)
                    .where(Run.name == spec.name, Run.trust_remote_code.is_(False))
                    .values(trust_remote_code=True)
                )
            # A run created before think-end ids were recorded for every think pair (0005)
            # or before its tokenizer's size was (0006): the same tokenizer fills them in.
            same_tokenizer = and_(
                Run.name == spec.name, Run.tokenizer_sha256 == spec.tokenizer_sha256
            )
            conn.execute(
                update(Run)
                .where(same_tokenizer, Run.think_end_id.is_(None))
                .values(think_end_id=spec.think_end_id)
            )
            conn.execute(
                update(Run)
                .where(same_tokenizer, Run.vocab_size.is_(None))
                .values(vocab_size=spec.vocab_size)
            )
            # A run from before families were recorded (0010) takes this enqueue's.
            conn.execute(
                update(Run).where(same_tokenizer, Run.family.is_(None)).values(family=spec.family)
            )
            row = conn.execute(
                select(
                    Run.id,
                    Run.tokenizer_sha256,
                    Run.chat_template_sha256,
                    Run.chat_template_kwargs,
                    Run.order_seed,
                    Run.family,
                ).where(Run.name == spec.name)
            ).one()
        differs = [
            what
            for what, stored, given in (
                ("tokenizer", row.tokenizer_sha256, spec.tokenizer_sha256),
                ("chat template", row.chat_template_sha256, spec.chat_template_sha256),
                ("chat_template_kwargs", row.chat_template_kwargs, spec.chat_template_kwargs),
                (
                    "order seed",
                    row.order_seed,
                    row.order_seed if spec.order_seed is None else spec.order_seed,
                ),
            )
            if stored != given
        ]
        if differs:
            raise RunMismatchError(
                f"run {spec.name!r} was created with another {' and '.join(differs)}; "
                "a run never mixes two tokenizations: start a new run (--run NEW_NAME)"
            )
        _check_family(spec, row.family)
        return int(row.id)

    def run_family(self, run: str) -> str | None:
        """The model family a run recorded (None: no such run, or none recorded)."""
        with self.engine.connect() as conn:
            return conn.scalar(select(Run.family).where(Run.name == run))

    def dataset_turns(self, dataset_id: int) -> str:
        """What a dataset answers of a multi-turn row: 'all' or 'last' (datasets.turns)."""
        with self.engine.connect() as conn:
            return str(conn.scalar(select(Dataset.turns).where(Dataset.id == dataset_id)))

    def dataset_samples(self, dataset_id: int) -> tuple[int, list[dict[str, Any]]]:
        """A dataset's samples per prompt and its variants as stored (core.samples)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(Dataset.samples, Dataset.variants).where(Dataset.id == dataset_id)
            ).one()
        return int(row.samples), list(row.variants or [])

    def order_seed(self, run: str) -> int | None:
        """The publishing order's seed of a run (None: no such run)."""
        with self.engine.connect() as conn:
            return conn.scalar(select(Run.order_seed).where(Run.name == run))

    def ensure_dataset(self, run_id: int, spec: DatasetSpec) -> int:
        """The dataset's id, creating it; refuse changed sampling params. A reserve policy
        the spec names is applied to a dataset that exists too: it only decides what the
        next claims reserve (docs/design.md §4)."""
        reserve = {} if spec.reserve is None else {"reserve": ReservePolicy(spec.reserve).value}
        with self.engine.begin() as conn:
            conn.execute(
                pg_insert(Dataset)
                .values(
                    run_id=run_id,
                    name=spec.name,
                    source=spec.source,
                    sampling_params=spec.sampling_params,
                    budget_tokens=spec.budget_tokens,
                    budget_basis=spec.budget_basis,
                    turns=spec.turns or "all",
                    samples=spec.samples or 1,
                    variants=spec.variants or [],
                    **reserve,
                )
                .on_conflict_do_nothing(index_elements=[Dataset.run_id, Dataset.name])
            )
            row = conn.execute(
                select(
                    Dataset.id,
                    Dataset.sampling_params,
                    Dataset.budget_basis,
                    Dataset.samples,
                    Dataset.variants,
                ).where(Dataset.run_id == run_id, Dataset.name == spec.name)
            ).one()
            same_params = _same_params(row.sampling_params, spec)
            unchanged = same_params and row.budget_basis == spec.budget_basis
            _check_samples(spec, row.samples, row.variants)
            if spec.samples is not None and spec.samples > row.samples and unchanged:
                conn.execute(
                    update(Dataset).where(Dataset.id == row.id).values(samples=spec.samples)
                )
            if reserve and unchanged:  # else refused below, and nothing changes
                conn.execute(
                    update(Dataset)
                    .where(Dataset.id == row.id, Dataset.reserve != reserve["reserve"])
                    .values(**reserve)
                )
        if not same_params:
            raise DatasetMismatchError(
                f"dataset {spec.name!r} already has jobs with sampling params "
                f"{row.sampling_params}; start a new run (--run NEW_NAME) to change them"
            )
        if row.budget_basis != spec.budget_basis:
            # The ledger has counted tokens on the stored basis; switching would mix two.
            raise DatasetMismatchError(
                f"dataset {spec.name!r} counts its budget on the {row.budget_basis!r} basis; "
                "start a new run (--run NEW_NAME) to count on another"
            )
        return int(row.id)

    # --- producer ----------------------------------------------------------------------

    def insert_jobs(
        self, dataset_id: int, jobs: JobBatch | Sequence[NewJob], *, expect_new: bool = False
    ) -> list[int]:
        """Insert jobs, skipping prompts the dataset already has; the new ids, in row order.

        ``expect_new``: the caller believes none exists yet (a dataset's first enqueue), so
        they are copied straight into `jobs`; if one does exist, the result is the same.
        """
        batch = jobs if isinstance(jobs, JobBatch) else JobBatch.of(jobs)
        if not batch:
            return []
        with self.engine.begin() as conn:
            seed = dataset_order_seed(conn, dataset_id)
            with driver_cursor(conn) as cursor:
                # Samples name each other: only the staged insert can (see above).
                fast = expect_new and not batch.sampled
                ids = _copy_new_jobs(cursor, dataset_id, batch, seed) if fast else None
                if ids is None:
                    ids = _insert_staged(cursor, dataset_id, batch, seed)
            if ids:
                conn.execute(
                    update(Dataset)
                    .where(Dataset.id == dataset_id)
                    .values(moved(None, JobState.QUEUED, len(ids)))
                )
            return ids

    def record_rejections(self, dataset_id: int, rejections: Iterable[Rejection]) -> None:
        """Store rejected rows; a row rejected again on a re-run is kept once."""
        values = [
            {
                "dataset_id": dataset_id,
                "row_index": r.row_index,
                "reason": r.reason,
                "excerpt": r.excerpt,
            }
            for r in rejections
        ]
        if not values:
            return
        stmt = pg_insert(RejectedRow).on_conflict_do_nothing(
            index_elements=[RejectedRow.dataset_id, RejectedRow.row_index]
        )
        with self.engine.begin() as conn:
            conn.execute(stmt, values)

    # --- reports -----------------------------------------------------------------------

    def counts(self, run: str | None = None) -> list[DatasetCounts]:
        """Jobs by state and token totals per dataset, optionally of one run."""
        states = (
            select(
                Run.name.label("run"),
                Dataset.name.label("dataset"),
                Job.state,
                func.count().label("n"),
                func.sum(Job.prompt_tokens).label("prompt"),
            )
            .join(Dataset, Dataset.run_id == Run.id)
            .join(Job, Job.dataset_id == Dataset.id)
            .group_by(Run.name, Dataset.name, Job.state)
        )
        completions = (
            select(
                Run.name.label("run"),
                Dataset.name.label("dataset"),
                func.sum(Generation.completion_tokens).label("completion"),
            )
            .join(Dataset, Dataset.run_id == Run.id)
            .join(Job, Job.dataset_id == Dataset.id)
            .join(Generation, Generation.job_id == Job.id)
            .group_by(Run.name, Dataset.name)
        )
        if run is not None:
            states = states.where(Run.name == run)
            completions = completions.where(Run.name == run)
        with self.engine.connect() as conn:
            state_rows = conn.execute(states).all()
            completion_rows = {
                (r.run, r.dataset): int(r.completion or 0) for r in conn.execute(completions)
            }
        return _assemble_counts(state_rows, completion_rows)

    def open_jobs(self, run: str) -> int:
        """Jobs of ``run`` still queued or running, from its datasets' job counters: one
        row read per dataset, where `counts` scans the run's jobs and generations. For
        waiting on a run while workers record into it."""
        open_jobs = func.coalesce(func.sum(Dataset.jobs_queued + Dataset.jobs_running), 0)
        query = select(open_jobs).join(Run, Run.id == Dataset.run_id).where(Run.name == run)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())


def _check_samples(spec: DatasetSpec, samples: int, variants: list[dict[str, Any]]) -> None:
    """Refuse fewer samples than the dataset asks (nothing is ever deleted) or other
    variants than it has (its jobs were drawn among those)."""
    if spec.samples is not None and spec.samples < samples:
        raise DatasetMismatchError(
            f"dataset {spec.name!r} asks {samples} samples of each prompt; {spec.samples} would "
            "leave jobs that were asked for: nothing is deleted. Keep samples = "
            f"{samples} (export --samples-per-prompt {spec.samples} writes {spec.samples} "
            "of each), or start a new run (--run NEW_NAME)"
        )
    if spec.variants is not None and spec.variants != variants:
        names = ", ".join(str(v.get("name")) for v in variants) or "none"
        raise DatasetMismatchError(
            f"dataset {spec.name!r} has other variants ({names}); its jobs were drawn among "
            "them: start a new run (--run NEW_NAME) to change them"
        )


def _check_family(spec: RunSpec, recorded: str | None) -> None:
    """Refuse an enqueue that names another family than the run recorded (one detected
    reads the run as it was recorded: the tokenizer and template are the same)."""
    if spec.family_named and recorded is not None and recorded != spec.family:
        raise RunMismatchError(
            f"run {spec.name!r} is recorded as model family {recorded!r}, this enqueue names "
            f"{spec.family!r}: a run reads all its generations one way; start a new run "
            "(--run NEW_NAME) or drop `family`"
        )


def _same_params(stored: dict[str, Any], spec: DatasetSpec) -> bool:
    """Whether ``spec`` asks for the sampling params the dataset stored: stop ids the
    tokenizer's default keep the stored ones (an enqueue before the default's rule changed
    stored others, which the dataset's jobs were sent with)."""
    if stored == spec.sampling_params:
        return True
    if not spec.stops_defaulted:
        return False
    return _without_stops(stored) == _without_stops(spec.sampling_params)


def _without_stops(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "stop_token_ids"}


def _assemble_counts(
    state_rows: Sequence[Any], completions: dict[tuple[str, str], int]
) -> list[DatasetCounts]:
    grouped: dict[tuple[str, str], tuple[dict[str, int], int]] = {}
    for row in state_rows:
        states, prompt = grouped.get((row.run, row.dataset), ({}, 0))
        states[row.state] = int(row.n)
        grouped[(row.run, row.dataset)] = (states, prompt + int(row.prompt or 0))
    return [
        DatasetCounts(
            run=run,
            dataset=dataset,
            states={s.value: states.get(s.value, 0) for s in JobState},
            prompt_tokens=prompt,
            completion_tokens=completions.get((run, dataset), 0),
        )
        for (run, dataset), (states, prompt) in sorted(grouped.items())
    ]
