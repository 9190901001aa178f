"""The tables of docs/design.md §4. Changes go through an Alembic migration too."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSON, JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from models.states import JobState
from models.tokens import pack, unpack

_STATES = ", ".join(f"'{s.value}'" for s in JobState)


class TokenArray(TypeDecorator[list[int]]):
    """A column holding a list of token ids (models.tokens' packed bytes)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> list[int] | None:
        return None if value is None else unpack(bytes(value))


class Base(DeclarativeBase):
    """Declarative base; ``Base.metadata`` is what migrations are checked against."""


def _now() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def _counter() -> Mapped[int]:
    return mapped_column(BigInteger, server_default="0", nullable=False)


class Run(Base):
    """One data-generation run for one target model and tokenizer."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    tokenizer_path: Mapped[str] = mapped_column(Text)
    tokenizer_sha256: Mapped[str] = mapped_column(String(64))
    chat_template_sha256: Mapped[str] = mapped_column(String(64))
    model_name: Mapped[str] = mapped_column(Text)
    chat_template_kwargs: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    max_context_len: Mapped[int | None] = mapped_column(Integer, nullable=True)
    package_versions: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    # The tokenizer's think-end token, when it has a think-start/think-end pair: a job whose
    # prompt opens a reasoning block (jobs.opens_reasoning) must emit it before its answer.
    think_end_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # len(tokenizer): every output id a worker stores is in [0, vocab_size).
    vocab_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Seeds the publishing order of the run's jobs (models.order): recorded, so that a
    # re-run with the same seed generates the same sample under the same budgets.
    order_seed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # The model family whose layout its generations have (core.families), detected at
    # enqueue or named by the run file; NULL for runs before 0010: readers detect it again.
    family: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # The enqueue's consent to the tokenizer's own code: the advancer (worker.advancer)
    # loads the same tokenizer to template a conversation's next turn.
    trust_remote_code: Mapped[bool] = mapped_column(Boolean, server_default=false())
    created_at: Mapped[datetime] = _now()


class Dataset(Base):
    """A prompt collection inside a run, with its sampling params and token budget."""

    __tablename__ = "datasets"
    __table_args__ = (
        UniqueConstraint("run_id", "name"),
        CheckConstraint("budget_basis IN ('completion', 'total')", name="budget_basis_known"),
        CheckConstraint("used_tokens >= 0 AND reserved_tokens >= 0", name="ledger_nonnegative"),
        CheckConstraint("reserve IN ('observed', 'worst_case')", name="reserve_known"),
        CheckConstraint("turns IN ('all', 'last')", name="turns_known"),
        CheckConstraint("samples >= 1", name="samples_positive"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(Text)
    sampling_params: Mapped[dict[str, Any]] = mapped_column(JSONB)
    budget_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    budget_basis: Mapped[str] = mapped_column(String(16), server_default="completion")
    used_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # What a claim reserves (models.ledger.ReservePolicy), and under "observed" the
    # completion tokens it reserves: refreshed by the record every few done jobs from the
    # latest lengths (models.attempt), so the claim reads a column, never the generations.
    # NULL: too few lengths yet, the worst case is reserved.
    reserve: Mapped[str] = mapped_column(String(16), server_default="observed")
    # 'all': every answer point of a multi-turn row is answered on-policy, one job per turn
    # (a `conversations` row); 'last': the row's last point only, after the row's history.
    turns: Mapped[str] = mapped_column(String(8), server_default="all")
    observed_reserve_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Generations asked of each prompt (of each conversation), and the named sampling
    # variants they are spread over (core.samples; [] for none): raised by a later enqueue,
    # never lowered; the variants never change.
    samples: Mapped[int] = mapped_column(Integer, server_default="1")
    variants: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, server_default="[]")
    # Jobs by state and the done jobs' tokens, moved by the statement of each transaction
    # that moves a job (models.counters): `status` reads them instead of scanning the jobs.
    jobs_queued: Mapped[int] = _counter()
    jobs_running: Mapped[int] = _counter()
    jobs_done: Mapped[int] = _counter()
    jobs_failed: Mapped[int] = _counter()
    jobs_skipped: Mapped[int] = _counter()
    done_prompt_tokens: Mapped[int] = _counter()
    done_completion_tokens: Mapped[int] = _counter()
    first_done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = _now()


class Job(Base):
    """One prompt to generate from; the state machine lives in ``models.states``."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("dataset_id", "prompt_sha256"),
        CheckConstraint(f"state IN ({_STATES})", name="state_known"),
        Index("ix_jobs_state_dataset", "state", "dataset_id"),
        Index("ix_jobs_running_lease", "lease_until", postgresql_where="state = 'running'"),
        # The feeder's two reads (worker.feeder): the next jobs of a dataset in its order,
        # and how many of a dataset's queued jobs have a message out.
        Index(
            "ix_jobs_feed_order",
            "dataset_id",
            "sort_key",
            postgresql_where="state = 'queued' AND published_at IS NULL",
        ),
        Index(
            "ix_jobs_feed_published",
            "dataset_id",
            postgresql_where="state = 'queued' AND published_at IS NOT NULL",
        ),
        CheckConstraint("reserved_tokens >= 0", name="reserved_nonnegative"),
        CheckConstraint("(prompt_of IS NULL) = (input_ids IS NOT NULL)", name="prompt_stored_once"),
        Index(
            "ix_jobs_conversation_turn",
            "conversation_id",
            "turn",
            unique=True,
            postgresql_where="conversation_id IS NOT NULL",
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    row_index: Mapped[int] = mapped_column(Integer)
    prompt_sha256: Mapped[bytes] = mapped_column(BYTEA)  # the digest: half the index of hex
    # NULL when ``prompt_of`` holds them (and the messages): a prompt's ids are stored once.
    input_ids: Mapped[list[int] | None] = mapped_column(TokenArray, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    # json, not jsonb: kept as written (for export), cheaper to insert, and able to hold
    # a NUL character; nothing queries inside it.
    messages: Mapped[Any] = mapped_column(JSON, nullable=True)
    # The prompt leaves the model inside a reasoning block: its output must hold think-end.
    opens_reasoning: Mapped[bool] = mapped_column(Boolean, server_default=false())
    state: Mapped[str] = mapped_column(String(16), server_default=JobState.QUEUED.value)
    # Its place in the dataset's publishing order (models.order.sort_key).
    sort_key: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # When the feeder published a message for it (None: it has none out); a job sent back
    # after an attempt is not published again before not_before (its backoff).
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    not_before: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # Budget this job holds while running (its reservation, docs/design.md §4), 0 otherwise.
    reserved_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    worker: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = _now()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # A turn of an on-policy conversation (datasets.turns = 'all'): which, and its index
    # from 0; NULL for a job of its own.
    conversation_id: Mapped[int | None] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), nullable=True
    )
    turn: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Which of its prompt's samples it is (from 0), its variant (None: the dataset's
    # sampling as it is) and the sampling_seed it is sent with (None: none is sent).
    sample: Mapped[int] = mapped_column(Integer, server_default="0")
    variant: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sampling_seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The job of its prompt's sample 0 (None: it is that job); the job holding its prompt
    # ids and messages (None: its own columns do).
    prompt_job: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True
    )
    prompt_of: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True
    )


def stored_prompt(column: str, job: str = "jobs") -> str:
    """SQL for the ``column`` (``input_ids`` or ``messages``) of the job ``job`` (a table
    name or alias in the query): its own, or its holder's when it stores none
    (``prompt_of``). A subquery read only for such rows: a plain job's costs nothing."""
    return (
        f"CASE WHEN {job}.prompt_of IS NULL THEN {job}.{column} ELSE "
        f"(SELECT holder.{column} FROM jobs holder WHERE holder.id = {job}.prompt_of) END"
    )


class Conversation(Base):
    """A multi-turn row answered turn by turn on-policy (core.dialogue): the row as
    normalised, how many answer points it has and how many turns (jobs) exist so far.

    ``state``: 'active' (its latest turn is queued or running), 'waiting' (that turn is
    settled; the advancer decides what comes next: the migration's trigger sets it),
    'done' (every point answered) or 'ended' (``ended_reason``, one of
    core.dialogue.END_REASONS or 'budget'; the turns after it are never generated).
    """

    __tablename__ = "conversations"
    __table_args__ = (
        UniqueConstraint("dataset_id", "digest"),
        CheckConstraint(
            "state IN ('active', 'waiting', 'ended', 'done')", name="conversation_state_known"
        ),
        Index("ix_conversations_waiting", "id", postgresql_where="state = 'waiting'"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    row_index: Mapped[int] = mapped_column(Integer)
    # The row's identity in its dataset: the hash of its messages and tools as stored.
    digest: Mapped[bytes] = mapped_column(BYTEA)
    source: Mapped[Any] = mapped_column(JSON)  # {"messages": [...], "tools": [...] | null}
    points: Mapped[int] = mapped_column(Integer)
    turns: Mapped[int] = mapped_column(Integer, server_default="1")
    state: Mapped[str] = mapped_column(String(16), server_default="active")
    ended_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # As a job's (Job.sample, .variant, .sampling_seed): every turn takes them; the
    # conversation of the row's sample 0 (None: it is that one).
    sample: Mapped[int] = mapped_column(Integer, server_default="0")
    variant: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sampling_seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    first_sample: Mapped[int | None] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), nullable=True
    )
    created_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=True
    )
    updated_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=True
    )


class Generation(Base):
    """The exact output of one job; the primary key makes a second record impossible."""

    __tablename__ = "generations"
    # `status` reads the last minutes of generations by this index: its cost stays that of
    # the window however long the run.
    __table_args__ = (Index("ix_generations_created_at", "created_at"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # The job's dataset, copied at recording: `status` sums a dataset's last minutes from
    # the time index alone, with no join to jobs. No foreign key: the job's already removes
    # the row with its dataset, and the copy never changes.
    dataset_id: Mapped[int] = mapped_column(BigInteger)
    output_ids: Mapped[list[int]] = mapped_column(TokenArray)
    finish_type: Mapped[str] = mapped_column(String(16))
    finish_matched: Mapped[Any] = mapped_column(JSONB, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    e2e_latency: Mapped[float] = mapped_column(Float)
    server: Mapped[str] = mapped_column(Text)
    # Reasoning runs only: whether the think-end token was generated, and the split.
    think_end_present: Mapped[bool | None] = mapped_column(nullable=True)
    reasoning_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    answer_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    meta_info: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _now()


class FailedAttempt(Base):
    """One failed attempt (retried or final): which server, what class of error, when.

    `status` shows errors by server and class over the last minutes; the job keeps only its
    last error. Rows are few (one per failed attempt) and read by time range.
    """

    __tablename__ = "failed_attempts"
    __table_args__ = (Index("ix_failed_attempts_at", "at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    server: Mapped[str | None] = mapped_column(Text, nullable=True)  # None: no server's fault
    kind: Mapped[str] = mapped_column(String(32))
    at: Mapped[datetime] = _now()


class RejectedRow(Base):
    """A dataset row that never became a job, and why."""

    __tablename__ = "rejected_rows"
    __table_args__ = (UniqueConstraint("dataset_id", "row_index"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    row_index: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    excerpt: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = _now()
