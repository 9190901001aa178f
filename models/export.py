"""Queries of the export: the run's identity and its done generations, streamed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Engine,
    LargeBinary,
    Select,
    any_,
    bindparam,
    func,
    not_,
    select,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import ARRAY

from models.records import ExportCursor, ExportedGeneration, ExportRun
from models.schema import Dataset, Generation, Job, Run
from models.states import JobState

# Rows fetched per round trip of the server-side cursor: a reasoning trace of 32k tokens is
# 128 KB packed, so 256 rows stay within tens of MB whatever the row length, and short rows
# still cross in few round trips.
_YIELD_ROWS = 256
_T = TypeVar("_T")


@dataclass(frozen=True)
class ExportScan:
    """A streaming read: ``started_at`` is the server's clock when it began (the
    transaction's ``now()``), ``rows`` the generations in job id order."""

    started_at: datetime
    rows: Iterator[ExportedGeneration]


@dataclass(frozen=True)
class PromptedGeneration:
    """A generation with what its job stores of the prompt: the source ``messages`` document
    (``{"messages": [...], "tools": [...] | null}``) and whether it opened reasoning."""

    generation: ExportedGeneration
    messages: Any
    opens_reasoning: bool


@dataclass(frozen=True)
class PromptedScan:
    """As :class:`ExportScan`, each generation with its prompt (``--format conversations``)."""

    started_at: datetime
    rows: Iterator[PromptedGeneration]


class ExportQueries:
    """Mixin of the Repository: what `eaglegen export` reads."""

    engine: Engine

    def export_run(self, name: str) -> ExportRun | None:
        """The run named ``name`` with every dataset's sampling params, or None."""
        with self.engine.connect() as conn:
            run = conn.execute(select(Run).where(Run.name == name)).mappings().one_or_none()
            if run is None:
                return None
            sampling = {
                str(r.name): dict(r.sampling_params or {})
                for r in conn.execute(
                    select(Dataset.name, Dataset.sampling_params)
                    .where(Dataset.run_id == run["id"])
                    .order_by(Dataset.name)
                )
            }
        return ExportRun(
            id=int(run["id"]),
            name=str(run["name"]),
            model_name=str(run["model_name"]),
            tokenizer_path=str(run["tokenizer_path"]),
            tokenizer_sha256=str(run["tokenizer_sha256"]),
            chat_template_sha256=str(run["chat_template_sha256"]),
            chat_template_kwargs=dict(run["chat_template_kwargs"] or {}),
            think_end_id=run["think_end_id"],
            sampling=sampling,
            family=run["family"],
        )

    def done_counts(self, run_id: int) -> dict[str, int]:
        """Done jobs per dataset of the run (every dataset, 0 when none is done)."""
        stmt = (
            select(Dataset.name, func.count(Job.id))
            .select_from(Dataset)
            .outerjoin(Job, (Job.dataset_id == Dataset.id) & (Job.state == JobState.DONE.value))
            .where(Dataset.run_id == run_id)
            .group_by(Dataset.name)
        )
        with self.engine.connect() as conn:
            return {str(name): int(n) for name, n in conn.execute(stmt)}

    @contextmanager
    def export_scan(
        self,
        run_id: int,
        datasets: Sequence[str] | None = None,
        cursor: ExportCursor | None = None,
    ) -> Iterator[ExportScan]:
        """Stream the run's done generations (of ``datasets`` only, when given; after
        ``cursor``, when given) through a server-side cursor: memory stays constant."""
        stmt = _generations(run_id, datasets, cursor)
        with self._stream(stmt, _record) as (started_at, rows):
            yield ExportScan(started_at, rows)

    @contextmanager
    def prompted_scan(
        self,
        run_id: int,
        datasets: Sequence[str] | None = None,
        cursor: ExportCursor | None = None,
    ) -> Iterator[PromptedScan]:
        """As :meth:`export_scan`, each generation with its job's stored prompt."""
        stmt = _generations(run_id, datasets, cursor).add_columns(Job.messages, Job.opens_reasoning)
        with self._stream(stmt, _prompted) as (started_at, rows):
            yield PromptedScan(started_at, rows)

    @contextmanager
    def _stream(
        self, stmt: Select[*tuple[Any, ...]], record: Callable[[Any], _T]
    ) -> Iterator[tuple[datetime, Iterator[_T]]]:
        with self.engine.connect() as conn:
            started_at = conn.scalar(select(func.now()))
            assert started_at is not None, "now() always answers"
            result = conn.execute(
                stmt, execution_options={"stream_results": True, "yield_per": _YIELD_ROWS}
            )
            try:
                yield started_at, (record(row) for row in result)
            finally:
                result.close()


def _generations(
    run_id: int, datasets: Sequence[str] | None, cursor: ExportCursor | None
) -> Select[*tuple[Any, ...]]:
    """The export's one query. Ids come as the stored bytes: unpacking them into Python
    ints here would cost more than the whole rest of the export."""
    stmt: Select[*tuple[Any, ...]] = (
        select(
            Generation.job_id,
            Dataset.name.label("dataset"),
            Job.row_index,
            type_coerce(Job.input_ids, LargeBinary).label("prompt_packed"),
            type_coerce(Generation.output_ids, LargeBinary).label("output_packed"),
            Generation.finish_type,
            Generation.completion_tokens,
            Generation.cached_tokens,
            Generation.e2e_latency,
            Generation.server,
            Generation.think_end_present,
            Generation.reasoning_tokens,
            Generation.answer_tokens,
            Generation.created_at,
        )
        .join(Job, Job.id == Generation.job_id)
        .join(Dataset, Dataset.id == Job.dataset_id)
        .where(Dataset.run_id == run_id, Job.state == JobState.DONE.value)
        .order_by(Generation.job_id)
    )
    if datasets is not None:
        stmt = stmt.where(Dataset.name.in_(list(datasets)))
    if cursor is not None:
        stmt = stmt.where(Generation.created_at >= cursor.since)
        if cursor.seen:
            # One array parameter: an IN list would send one parameter per id.
            seen = bindparam("seen", sorted(cursor.seen), type_=ARRAY(BigInteger))
            stmt = stmt.where(not_(Generation.job_id == any_(seen)))
    return stmt


def _record(row: Any) -> ExportedGeneration:
    return ExportedGeneration(
        job_id=int(row.job_id),
        dataset=str(row.dataset),
        row_index=int(row.row_index),
        prompt_packed=bytes(row.prompt_packed),
        output_packed=bytes(row.output_packed),
        finish_type=str(row.finish_type),
        completion_tokens=int(row.completion_tokens),
        cached_tokens=int(row.cached_tokens),
        e2e_latency=float(row.e2e_latency),
        server=str(row.server),
        think_end_present=row.think_end_present,
        reasoning_tokens=row.reasoning_tokens,
        answer_tokens=row.answer_tokens,
        created_at=row.created_at,
    )


def _prompted(row: Any) -> PromptedGeneration:
    return PromptedGeneration(_record(row), row.messages, bool(row.opens_reasoning))
