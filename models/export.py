"""Queries of the export: the run's identity and its done generations, streamed.

An export of whole conversations (``--merge-turns``, ``--format conversations``) reads them
apart: the generations of plain jobs first, in job id order, then the done turns of every
conversation in a final state (done or ended), conversation by conversation in turn order,
so that one conversation at a time is in memory. A conversation still under way is left for
a later pass; its final state is stamped (``conversations.updated_at``) by the transaction
that decided it, which an incremental export resumes from as it does from a generation's
``created_at``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Engine,
    LargeBinary,
    Select,
    any_,
    bindparam,
    case,
    func,
    literal_column,
    not_,
    select,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSON
from sqlalchemy.orm import aliased

from models.conversations import DONE, ENDED
from models.records import ExportCursor, ExportedGeneration, ExportRun
from models.schema import Conversation, Dataset, Generation, Job, Run, stored_prompt
from models.states import JobState

# The states after which a conversation has no turn to come.
FINAL = (DONE, ENDED)

# Rows fetched per round trip of the server-side cursor: a reasoning trace of 32k tokens is
# 128 KB packed, so 256 rows stay within tens of MB whatever the row length, and short rows
# still cross in few round trips.
_YIELD_ROWS = 256
_T = TypeVar("_T")
_PromptOf = aliased(Conversation, name="sample_zero")


# The conversation of a turn's sample 0 (itself unless the dataset has several samples).
_FIRST_CONVERSATION = case(
    (Job.conversation_id.is_(None), None),
    else_=select(func.coalesce(_PromptOf.first_sample, _PromptOf.id))
    .where(_PromptOf.id == Job.conversation_id)
    .scalar_subquery(),
)


@dataclass(frozen=True)
class PromptedGeneration:
    """A generation with what its job stores of the prompt: the source ``messages`` document
    (``{"messages": [...], "tools": [...] | null}``) and whether it opened reasoning."""

    generation: ExportedGeneration
    messages: Any
    opens_reasoning: bool


@dataclass(frozen=True)
class ExportedConversation:
    """A conversation in a final state and its done turns in order (each with its prompt
    when the scan is prompted; else ``messages`` is None)."""

    id: int
    dataset: str
    state: str  # done or ended
    ended_reason: str | None
    updated_at: datetime  # when it reached that state
    turns: list[PromptedGeneration]


@dataclass(frozen=True)
class ExportScan:
    """A streaming read: ``started_at`` is the server's clock when it began (the
    transaction's ``now()``), ``rows`` the generations in job id order (of plain jobs only
    when conversations are read whole), then ``conversations`` (empty unless asked for)."""

    started_at: datetime
    rows: Iterator[ExportedGeneration]
    conversations: Iterator[ExportedConversation] = field(default_factory=lambda: iter(()))


@dataclass(frozen=True)
class PromptedScan:
    """As :class:`ExportScan`, each generation with its prompt (``--format conversations``)."""

    started_at: datetime
    rows: Iterator[PromptedGeneration]
    conversations: Iterator[ExportedConversation] = field(default_factory=lambda: iter(()))


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

    def under_way_turns(self, run_id: int, datasets: Sequence[str] | None = None) -> dict[str, int]:
        """Per dataset, the done turns of conversations still under way (an export of whole
        conversations leaves them for a later pass); datasets without any are absent."""
        stmt = (
            select(Dataset.name, func.count(Job.id))
            .select_from(Job)
            .join(Conversation, Conversation.id == Job.conversation_id)
            .join(Dataset, Dataset.id == Job.dataset_id)
            .where(
                Dataset.run_id == run_id,
                Job.state == JobState.DONE.value,
                Conversation.state.not_in(FINAL),
            )
            .group_by(Dataset.name)
        )
        if datasets is not None:
            stmt = stmt.where(Dataset.name.in_(list(datasets)))
        with self.engine.connect() as conn:
            return {str(name): int(n) for name, n in conn.execute(stmt)}

    @contextmanager
    def export_scan(
        self,
        run_id: int,
        datasets: Sequence[str] | None = None,
        cursor: ExportCursor | None = None,
        *,
        whole: bool = False,
    ) -> Iterator[ExportScan]:
        """Stream the run's done generations (of ``datasets`` only, when given; after
        ``cursor``, when given) through a server-side cursor: memory stays constant.
        ``whole``: conversations apart, whole (the module's docstring)."""
        stmt = _generations(run_id, datasets, cursor, plain_only=whole)
        turns = _turns(run_id, datasets, cursor) if whole else None
        with self._stream(stmt, _record, turns) as (started_at, rows, conversations):
            yield ExportScan(started_at, rows, conversations)

    @contextmanager
    def prompted_scan(
        self,
        run_id: int,
        datasets: Sequence[str] | None = None,
        cursor: ExportCursor | None = None,
        *,
        whole: bool = False,
    ) -> Iterator[PromptedScan]:
        """As :meth:`export_scan`, each generation with its job's stored prompt."""
        stmt = _with_prompt(_generations(run_id, datasets, cursor, plain_only=whole))
        turns = _with_prompt(_turns(run_id, datasets, cursor)) if whole else None
        with self._stream(stmt, _prompted, turns) as (started_at, rows, conversations):
            yield PromptedScan(started_at, rows, conversations)

    @contextmanager
    def _stream(
        self,
        stmt: Select[*tuple[Any, ...]],
        record: Callable[[Any], _T],
        turns: Select[*tuple[Any, ...]] | None = None,
    ) -> Iterator[tuple[datetime, Iterator[_T], Iterator[ExportedConversation]]]:
        """The rows of ``stmt``, then the conversations of ``turns`` (read once the rows
        are), in one connection; every cursor closed at the end, read to its end or not."""
        with self.engine.connect() as conn:
            started_at = conn.scalar(select(func.now()))
            assert started_at is not None, "now() always answers"
            results: list[Any] = []

            def rows(query: Select[*tuple[Any, ...]]) -> Iterator[Any]:
                result = conn.execute(
                    query, execution_options={"stream_results": True, "yield_per": _YIELD_ROWS}
                )
                results.append(result)
                yield from result
                result.close()

            generations = (record(row) for row in rows(stmt))
            conversations = iter(()) if turns is None else _conversations(rows(turns))
            try:
                yield started_at, generations, conversations
            finally:
                for result in results:
                    result.close()


def _done(run_id: int, datasets: Sequence[str] | None) -> Select[*tuple[Any, ...]]:
    """The run's done generations with what a row needs. Ids come as the stored bytes:
    unpacking them into Python ints here would cost more than the whole rest of the export."""
    stmt: Select[*tuple[Any, ...]] = (
        select(
            Generation.job_id,
            Dataset.name.label("dataset"),
            Job.row_index,
            literal_column(stored_prompt("input_ids"), LargeBinary).label("prompt_packed"),
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
            Job.conversation_id,
            Job.turn,
            Job.sample,
            Job.variant,
            func.coalesce(Job.prompt_job, Job.id).label("first_job"),
            _FIRST_CONVERSATION.label("first_conversation"),
            ((Dataset.samples > 1) | (func.jsonb_array_length(Dataset.variants) > 0)).label(
                "sampled"
            ),
        )
        .join(Job, Job.id == Generation.job_id)
        .join(Dataset, Dataset.id == Job.dataset_id)
        .where(Dataset.run_id == run_id, Job.state == JobState.DONE.value)
    )
    if datasets is not None:
        stmt = stmt.where(Dataset.name.in_(list(datasets)))
    return stmt


def _generations(
    run_id: int,
    datasets: Sequence[str] | None,
    cursor: ExportCursor | None,
    *,
    plain_only: bool = False,
) -> Select[*tuple[Any, ...]]:
    """The export's query of generations, in job id order (of plain jobs only, when
    conversations are read whole)."""
    stmt = _done(run_id, datasets).order_by(Generation.job_id)
    if plain_only:
        stmt = stmt.where(Job.conversation_id.is_(None))
    if cursor is not None:
        stmt = stmt.where(Generation.created_at >= cursor.since)
        if cursor.seen:
            stmt = stmt.where(not_(Generation.job_id == any_(_ids("seen", cursor.seen))))
    return stmt


def _turns(
    run_id: int, datasets: Sequence[str] | None, cursor: ExportCursor | None
) -> Select[*tuple[Any, ...]]:
    """The done turns of the conversations in a final state, conversation by conversation
    in turn order; after ``cursor``, of those that reached it since."""
    stmt = (
        _done(run_id, datasets)
        .add_columns(
            Conversation.state.label("conversation_state"),
            Conversation.ended_reason,
            Conversation.updated_at.label("conversation_at"),
        )
        .join(Conversation, Conversation.id == Job.conversation_id)
        .where(Conversation.state.in_(FINAL))
        .order_by(Job.conversation_id, Job.turn)
    )
    if cursor is not None:
        stmt = stmt.where(Conversation.updated_at >= cursor.since)
        if cursor.conversations:
            seen = _ids("seen_conversations", cursor.conversations)
            stmt = stmt.where(not_(Conversation.id == any_(seen)))
    return stmt


def _ids(name: str, ids: frozenset[int]) -> Any:
    # One array parameter: an IN list would send one parameter per id.
    return bindparam(name, sorted(ids), type_=ARRAY(BigInteger))


def _with_prompt(stmt: Select[*tuple[Any, ...]]) -> Select[*tuple[Any, ...]]:
    return stmt.add_columns(
        literal_column(stored_prompt("messages"), JSON).label("messages"), Job.opens_reasoning
    )


def _conversations(rows: Iterator[Any]) -> Iterator[ExportedConversation]:
    """Consecutive turn rows grouped by their conversation."""
    for conversation_id, group in itertools.groupby(rows, key=lambda r: r.conversation_id):
        turns = list(group)
        first = turns[0]
        yield ExportedConversation(
            id=int(conversation_id),
            dataset=str(first.dataset),
            state=str(first.conversation_state),
            ended_reason=first.ended_reason,
            updated_at=first.conversation_at,
            turns=[_prompted(turn) for turn in turns],
        )


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
        conversation_id=row.conversation_id,
        turn=row.turn,
        sample=int(row.sample),
        variant=row.variant,
        first=int(row.first_job if row.conversation_id is None else row.first_conversation),
        sampled=bool(row.sampled),
    )


def _prompted(row: Any) -> PromptedGeneration:
    """A row as a prompted generation (its prompt None when the query did not read it)."""
    messages = getattr(row, "messages", None)
    return PromptedGeneration(_record(row), messages, bool(getattr(row, "opens_reasoning", False)))
