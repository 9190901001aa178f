"""Queries of on-policy conversations (datasets.turns = 'all'): storing a row's first turn,
and what the advancer (worker.advancer) reads and decides after each turn.

A conversation's turns are jobs like any other (claimed, recorded, budgeted, retried); what
is particular to them is that turn ``t + 1`` comes into being only once turn ``t`` is done,
its prompt made of the model's own earlier answers. The decision is one transaction that
re-checks what it read (`settle_conversation`), and the unique (conversation, turn) key
makes a second insert of a turn impossible: each turn is created once, whatever crashes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from core.samples import variant_named, variants_of, with_variant
from models.counters import moved
from models.order import sort_key
from models.records import NewConversation, turn_sha256
from models.schema import Conversation, Dataset, Generation, Job, Run
from models.states import JobState
from models.tokens import unpack

ACTIVE, WAITING, ENDED, DONE = "active", "waiting", "ended", "done"
# A conversation whose next turn its dataset's spent budget skipped.
BUDGET = "budget"


@dataclass(frozen=True)
class WaitingConversation:
    """A conversation whose latest turn is settled: what deciding its next step needs."""

    id: int
    dataset_id: int
    run_id: int
    source: Any
    points: int
    turns: int
    max_new_tokens: int
    max_context_len: int | None
    sampling_params: dict[str, Any]  # its dataset's and its variant's, stop ids among them
    # Its variant's chat-template kwargs, laid over the run's (core.samples).
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunTokenization:
    """How a run tokenized its prompts, as recorded: what loading its tokenizer again needs."""

    tokenizer_path: str
    trust_remote_code: bool
    chat_template_kwargs: dict[str, Any]
    family: str | None
    tokenizer_sha256: str
    chat_template_sha256: str


@dataclass(frozen=True)
class TurnResult:
    """One turn of a conversation as it stands: its job's state and, once done, its output."""

    turn: int
    state: str
    opens_reasoning: bool
    output_ids: list[int] | None
    finish_type: str | None
    server: str | None  # the server that generated it, once done


@dataclass(frozen=True)
class NextTurn:
    """The job of a conversation's next turn, templated."""

    input_ids: list[int]
    messages: str  # JSON text: {"messages": [...], "tools": [...] | null}
    opens_reasoning: bool


@dataclass(frozen=True)
class Settled:
    """A conversation decided: ``job_id`` is its next turn's new job (None: it ended or is
    done)."""

    job_id: int | None = None


@dataclass(frozen=True)
class ConversationCounts:
    """A dataset's conversations by state, and the ended ones by reason."""

    by_state: dict[str, int]
    ended_by_reason: dict[str, int]
    turns_created: int
    points: int

    @property
    def total(self) -> int:
        return sum(self.by_state.values())


class ConversationQueries:
    """Mixin of the Repository for conversations."""

    engine: Engine

    def insert_conversations(self, dataset_id: int, rows: Sequence[NewConversation]) -> list[bytes]:
        """Store the conversations the dataset lacks, each with its first turn's job, queued;
        the digests of those that were new."""
        if not rows:
            return []
        with self.engine.begin() as conn:
            seed = dataset_order_seed(conn, dataset_id)
            by_digest = {row.digest: row for row in rows}
            created = conn.execute(
                pg_insert(Conversation)
                .values(
                    [
                        {
                            "dataset_id": dataset_id,
                            "row_index": row.row_index,
                            "digest": digest,
                            "source": json.loads(row.source),
                            "points": row.points,
                            "sample": row.sample,
                            "variant": row.variant,
                            "sampling_seed": row.sampling_seed,
                        }
                        for digest, row in by_digest.items()
                    ]
                )
                .on_conflict_do_nothing(
                    index_elements=[Conversation.dataset_id, Conversation.digest]
                )
                .returning(Conversation.id, Conversation.digest)
            ).all()
            if not created:
                return []
            _link_first_samples(conn, dataset_id, created, by_digest)
            jobs = []
            for conversation_id, digest in created:
                row = by_digest[bytes(digest)]
                sha = turn_sha256(bytes(digest), 0)
                # Every sample of a row takes its sample 0's place in the order.
                key = sort_key(seed, turn_sha256(row.row_digest, 0))
                jobs.append(
                    {
                        "dataset_id": dataset_id,
                        "row_index": row.row_index,
                        "prompt_sha256": sha,
                        "input_ids": unpack(row.packed_ids),
                        "prompt_tokens": row.prompt_tokens,
                        "messages": json.loads(row.messages),
                        "opens_reasoning": row.opens_reasoning,
                        "sort_key": key,
                        "conversation_id": conversation_id,
                        "turn": 0,
                        "sample": row.sample,
                        "variant": row.variant,
                        "sampling_seed": row.sampling_seed,
                    }
                )
            conn.execute(pg_insert(Job), jobs)
            conn.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id)
                .values(moved(None, JobState.QUEUED, len(jobs)))
            )
            return [bytes(digest) for _, digest in created]

    def runs_waiting(self) -> list[int]:
        """The runs that have conversations waiting (by the partial index of those)."""
        stmt = (
            select(Dataset.run_id)
            .join(Conversation, Conversation.dataset_id == Dataset.id)
            .where(Conversation.state == WAITING)
            .distinct()
        )
        with self.engine.connect() as conn:
            return sorted(int(r) for r in conn.scalars(stmt))

    def waiting_conversations(self, run_id: int, limit: int) -> list[WaitingConversation]:
        """A run's conversations whose latest turn is settled, oldest first."""
        stmt = (
            select(
                Conversation.id,
                Conversation.dataset_id,
                Dataset.run_id,
                Conversation.source,
                Conversation.points,
                Conversation.turns,
                Conversation.variant,
                Dataset.sampling_params,
                Dataset.variants,
                Run.max_context_len,
            )
            .join(Dataset, Dataset.id == Conversation.dataset_id)
            .join(Run, Run.id == Dataset.run_id)
            .where(Conversation.state == WAITING, Dataset.run_id == run_id)
            .order_by(Conversation.id)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [_waiting(r) for r in conn.execute(stmt)]

    def run_tokenization(self, run_id: int) -> RunTokenization:
        """What the run recorded of its tokenizer and template."""
        with self.engine.connect() as conn:
            r = conn.execute(
                select(
                    Run.tokenizer_path,
                    Run.trust_remote_code,
                    Run.chat_template_kwargs,
                    Run.family,
                    Run.tokenizer_sha256,
                    Run.chat_template_sha256,
                ).where(Run.id == run_id)
            ).one()
        return RunTokenization(
            r.tokenizer_path,
            bool(r.trust_remote_code),
            dict(r.chat_template_kwargs or {}),
            r.family,
            r.tokenizer_sha256,
            r.chat_template_sha256,
        )

    def conversation_turns(self, conversation_id: int) -> list[TurnResult]:
        """A conversation's turns in order, each with its output once done."""
        stmt = (
            select(
                Job.turn,
                Job.state,
                Job.opens_reasoning,
                Generation.output_ids,
                Generation.finish_type,
                Generation.server,
            )
            .outerjoin(Generation, Generation.job_id == Job.id)
            .where(Job.conversation_id == conversation_id)
            .order_by(Job.turn)
        )
        with self.engine.connect() as conn:
            return [
                TurnResult(
                    turn=int(r.turn),
                    state=r.state,
                    opens_reasoning=bool(r.opens_reasoning),
                    output_ids=None if r.output_ids is None else list(r.output_ids),
                    finish_type=r.finish_type,
                    server=r.server,
                )
                for r in conn.execute(stmt)
            ]

    def settle_conversation(
        self,
        conversation_id: int,
        turns: int,
        *,
        latest: str,
        next_turn: NextTurn | None = None,
        ended: str | None = None,
    ) -> Settled | None:
        """Decide a waiting conversation whose ``turns`` turns exist and whose latest turn's
        job was read in state ``latest``: its next turn's job (``next_turn``), its end
        (``ended``, the reason) or, with neither, done. Nothing happens (None) when it is no
        longer so: someone decided it already, or its latest turn was sent back to the
        queue and settled again meanwhile (a failed turn retried and done)."""
        with self.engine.begin() as conn:
            locked = conn.execute(
                select(
                    Conversation.dataset_id,
                    Conversation.row_index,
                    Conversation.digest,
                    Conversation.sample,
                    Conversation.variant,
                    Conversation.sampling_seed,
                )
                .where(
                    Conversation.id == conversation_id,
                    Conversation.state == WAITING,
                    Conversation.turns == turns,
                )
                .with_for_update()
            ).one_or_none()
            if locked is None or latest != conn.scalar(
                select(Job.state).where(
                    Job.conversation_id == conversation_id, Job.turn == turns - 1
                )
            ):
                return None
            values: dict[str, Any] = {"updated_at": func.now()}
            decided = Settled()
            if next_turn is not None:
                decided = Settled(_insert_turn(conn, conversation_id, locked, turns, next_turn))
                values.update(state=ACTIVE, turns=turns + 1)
            elif ended is not None:
                values.update(state=ENDED, ended_reason=ended)
            else:
                values.update(state=DONE)
            conn.execute(
                update(Conversation).where(Conversation.id == conversation_id).values(**values)
            )
        return decided

    def conversations_under_way(self, run: str) -> int:
        """The run's conversations whose next turn may still come (active or waiting)."""
        stmt = (
            select(func.count())
            .select_from(Conversation)
            .join(Dataset, Dataset.id == Conversation.dataset_id)
            .join(Run, Run.id == Dataset.run_id)
            .where(Run.name == run, Conversation.state.in_((ACTIVE, WAITING)))
        )
        with self.engine.connect() as conn:
            return int(conn.scalar(stmt) or 0)

    def conversation_counts(self, dataset_ids: Sequence[int]) -> dict[int, ConversationCounts]:
        """Per dataset that has conversations: their states, end reasons and turns."""
        stmt = (
            select(
                Conversation.dataset_id,
                Conversation.state,
                Conversation.ended_reason,
                func.count(),
                func.sum(Conversation.turns),
                func.sum(Conversation.points),
            )
            .where(Conversation.dataset_id.in_(dataset_ids))
            .group_by(Conversation.dataset_id, Conversation.state, Conversation.ended_reason)
        )
        states: dict[int, Counter[str]] = {}
        reasons: dict[int, Counter[str]] = {}
        turns: Counter[int] = Counter()
        points: Counter[int] = Counter()
        with self.engine.connect() as conn:
            for dataset_id, state, reason, n, created, pts in conn.execute(stmt):
                states.setdefault(dataset_id, Counter())[state] += n
                if reason is not None:
                    reasons.setdefault(dataset_id, Counter())[reason] += n
                turns[dataset_id] += int(created or 0)
                points[dataset_id] += int(pts or 0)
        return {
            d: ConversationCounts(dict(states[d]), dict(reasons.get(d, {})), turns[d], points[d])
            for d in states
        }


def _waiting(r: Any) -> WaitingConversation:
    """A waiting conversation as read, its variant's sampling and kwargs applied."""
    variant = variant_named(variants_of(r.variants), r.variant)
    params = with_variant(r.sampling_params or {}, variant)
    return WaitingConversation(
        id=int(r.id),
        dataset_id=int(r.dataset_id),
        run_id=int(r.run_id),
        source=r.source,
        points=int(r.points),
        turns=int(r.turns),
        max_new_tokens=int(params.get("max_new_tokens", 0)),
        max_context_len=r.max_context_len,
        sampling_params=params,
        template_kwargs=dict(variant.template) if variant is not None else {},
    )


def _link_first_samples(
    conn: Connection, dataset_id: int, created: Sequence[Any], rows: dict[bytes, NewConversation]
) -> None:
    """Point each new conversation of a sample above 0 at its row's sample 0."""
    later = [(int(i), rows[bytes(d)]) for i, d in created if rows[bytes(d)].sample > 0]
    if not later:
        return
    firsts = dict(
        conn.execute(
            select(Conversation.digest, Conversation.id).where(
                Conversation.dataset_id == dataset_id,
                Conversation.digest.in_({row.row_digest for _, row in later}),
            )
        ).all()
    )
    for conversation_id, row in later:
        first = firsts.get(row.row_digest)
        if first is not None:
            conn.execute(
                update(Conversation)
                .where(Conversation.id == conversation_id)
                .values(first_sample=first)
            )


def dataset_order_seed(conn: Connection, dataset_id: int) -> int:
    """The publishing order's seed (models.order) of the dataset's run."""
    return int(
        conn.scalar(
            select(Run.order_seed)
            .join(Dataset, Dataset.run_id == Run.id)
            .where(Dataset.id == dataset_id)
        )
        or 0
    )


def _insert_turn(
    conn: Connection, conversation_id: int, conversation: Any, turn: int, job: NextTurn
) -> int:
    """Insert turn ``turn``'s job, queued, with its first turn's place in the publishing
    order: ahead of the dataset's conversations not yet begun (worker.feeder publishes by
    that order), so a budget holds whole conversations."""
    first_key = conn.scalar(
        select(Job.sort_key).where(Job.conversation_id == conversation_id, Job.turn == 0)
    )
    job_id = conn.scalar(
        pg_insert(Job)
        .values(
            dataset_id=conversation.dataset_id,
            row_index=conversation.row_index,
            prompt_sha256=turn_sha256(bytes(conversation.digest), turn),
            input_ids=job.input_ids,
            prompt_tokens=len(job.input_ids),
            messages=json.loads(job.messages),
            opens_reasoning=job.opens_reasoning,
            sort_key=int(first_key or 0),
            conversation_id=conversation_id,
            turn=turn,
            sample=conversation.sample,
            variant=conversation.variant,
            sampling_seed=conversation.sampling_seed,
        )
        .returning(Job.id)
    )
    conn.execute(
        update(Dataset)
        .where(Dataset.id == conversation.dataset_id)
        .values(moved(None, JobState.QUEUED, 1))
    )
    return int(job_id or 0)  # RETURNING of an INSERT without conflict: always a row
