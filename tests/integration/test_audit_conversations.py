"""`eaglegen audit` on conversations: it passes on real runs, live and finished, and each of
its checks names the inconsistency planted for it in the database of a finished run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, text

from core.dialogue import TRUNCATED
from core.settings import Settings
from models.repository import Repository
from models.schema import Conversation, Job
from tests.helpers import enqueue_file, write_jsonl
from tests.integration.test_conversations import chat, dataset_of, wait_conversations
from tests.workers import in_thread_worker

# Three user turns each: a conversation of three answer points.
ROWS = [chat(f"Question {i}?", "An answer.", "Why?", "Because.", "Sure?") for i in range(4)]


@dataclass(frozen=True)
class Plant:
    """An inconsistency written with SQL, the check that must name it, and its undoing."""

    name: str
    conversation: int  # the one it makes inconsistent
    sql: str
    found: str  # what the audit says of the conversation
    undo: str


def test_conversation_checks_pass_on_a_finished_run_and_name_each_planted_fault(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", ROWS)
    enqueue_file(settings, path, max_new_tokens=2048, turns="all")
    # Answers cut at one token: every conversation ends after its first turn.
    enqueue_file(settings, path, run="cut", max_new_tokens=1, turns="all")
    with in_thread_worker(settings):
        done = wait_conversations(repo, dataset_of(repo, "run"))
        ended = wait_conversations(repo, dataset_of(repo, "cut"))
    assert done.by_state == {"done": len(ROWS)}, done
    assert ended.ended_by_reason == {TRUNCATED: len(ROWS)}, ended
    assert repo.audit(lease_grace_s=0) == []

    d = _first_conversation(repo, "run")
    e = _first_conversation(repo, "cut")
    with repo.engine.connect() as conn:
        turn0, turn1, latest = conn.scalars(
            select(Job.id).where(Job.conversation_id == d).order_by(Job.turn)
        ).all()
    with repo.engine.begin() as conn:
        # The unique (conversation, turn) index forbids a duplicate: the audit must find one
        # all the same, should the index or what relies on it ever be lost.
        conn.execute(text("DROP INDEX ix_jobs_conversation_turn"))

    def job(job_id: int, assign: str) -> str:
        return f"UPDATE jobs SET {assign} WHERE id = {job_id}"

    def conversation(cid: int, assign: str) -> str:
        return f"UPDATE conversations SET {assign} WHERE id = {cid}"

    plants = [
        Plant(
            "gap",
            d,
            job(turn1, "turn = 7"),
            "whose jobs are not turns 0 to turns - 1 exactly",
            job(turn1, "turn = 1"),
        ),
        Plant(
            "duplicate",
            d,
            job(turn1, "turn = 0"),
            "with two jobs for one turn",
            job(turn1, "turn = 1"),
        ),
        Plant(
            "no turn",
            d,
            job(turn1, "turn = NULL"),
            "with a job that has no turn",
            job(turn1, "turn = 1"),
        ),
        Plant(
            "turns over points",
            d,
            conversation(d, "points = 2"),
            "with more turns than answer points",
            conversation(d, "points = 3"),
        ),
        Plant(
            "earlier turn not done",
            d,
            job(turn0, "state = 'failed'"),
            "with a turn before its latest that is not done",
            job(turn0, "state = 'done'"),
        ),
        Plant(
            "active, latest settled",
            d,
            conversation(d, "state = 'active'"),
            "active whose latest turn is not queued or running",
            conversation(d, "state = 'done'"),
        ),
        Plant(
            # The trigger makes the conversation active with its latest turn queued; then it
            # is set waiting behind the trigger's back.
            "waiting, latest queued",
            d,
            "; ".join([job(latest, "state = 'queued'"), conversation(d, "state = 'waiting'")]),
            "waiting whose latest turn is not settled",
            "; ".join([job(latest, "state = 'done'"), conversation(d, "state = 'done'")]),
        ),
        Plant(
            "done, a point unanswered",
            d,
            conversation(d, "points = 4"),
            "done before every answer point has its turn done",
            conversation(d, "points = 3"),
        ),
        Plant(
            "ended without a reason",
            e,
            conversation(e, "ended_reason = NULL"),
            "ended without a reason",
            conversation(e, f"ended_reason = '{TRUNCATED}'"),
        ),
        Plant(
            "ended failed, latest done",
            e,
            conversation(e, "ended_reason = 'failed'"),
            "ended whose latest turn is not settled as its reason says",
            conversation(e, f"ended_reason = '{TRUNCATED}'"),
        ),
        Plant(
            "reason but not ended",
            d,
            conversation(d, f"ended_reason = '{TRUNCATED}'"),
            "with an end reason but not ended",
            conversation(d, "ended_reason = NULL"),
        ),
    ]
    for plant in plants:
        with repo.engine.begin() as conn:
            conn.execute(text(plant.sql))
        problems = repo.audit(lease_grace_s=0)
        run = "cut" if plant.conversation == e else "run"
        named = [p for p in problems if plant.found in p]
        assert len(named) == 1, f"{plant.name}: {problems}"
        assert named[0].startswith(f"{run}/d: 1 conversation(s) {plant.found}"), named
        assert named[0].endswith(f"(first: conversation {plant.conversation})"), named
        with repo.engine.begin() as conn:
            conn.execute(text(plant.undo))
        assert repo.audit(lease_grace_s=0) == [], f"after undoing {plant.name}"


def test_conversation_checks_pass_at_every_moment_of_a_live_run(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # The trigger moves a conversation in the transaction that moves its latest turn, and
    # the advancer inserts a turn and counts it in one: a snapshot never sees them apart.
    rows = [chat(f"Live {i}?", "A.", "B?", "C.", "D?") for i in range(30)]
    enqueue_file(settings, write_jsonl(tmp_path / "live.jsonl", rows), turns="all")
    audits: list[list[str]] = []
    dataset = dataset_of(repo, "run")
    with in_thread_worker(settings):
        while True:
            counts = repo.conversation_counts([dataset])[dataset]
            settled = counts.by_state.get("done", 0) + counts.by_state.get("ended", 0)
            finished = settled == counts.total and all(
                c.states["queued"] + c.states["running"] == 0 for c in repo.counts()
            )
            audits.append(repo.audit(lease_grace_s=600))
            if finished:
                break
    assert len(audits) > 1
    failed = [problems for problems in audits if problems]
    assert not failed, f"{len(failed)} of {len(audits)} audits failed, first: {failed[0]}"
    assert repo.conversation_counts([dataset])[dataset].turns_created > len(rows)


def _first_conversation(repo: Repository, run: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.scalar(
                select(Conversation.id)
                .where(Conversation.dataset_id == dataset_of(repo, run))
                .order_by(Conversation.id)
                .limit(1)
            )
        )
