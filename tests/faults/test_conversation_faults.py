"""On-policy conversations under faults (issue 30): worker processes killed with SIGKILL, the
advancer's among them, Redis flushed and Postgres restarted, while multi-turn rows are
answered turn by turn.
Each turn's job must come into being exactly once, templated from the model's own answers.

What is at stake here is the advancer's and the feeder's (worker.background's side loops, the
same on either engine): these run against the default engine, where the kills and restarts
of a plain run (test_kill_workers, test_service_restarts, test_soak) and the conversations
themselves (tests/integration/test_conversations.py) run against each."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select
from transformers import AutoTokenizer

from core import keys
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.repository import Repository
from models.schema import Conversation, Generation, Job
from models.states import JobState
from tests.faults.conftest import OwnServicesRun
from tests.faults.harness import (
    Fleet,
    PrivatePostgres,
    PrivateRedis,
    WorkerProcess,
    busiest,
    report,
    running_on,
    state_counts,
    wait_for,
    wait_settled,
)
from tests.helpers import enqueue_file, write_jsonl
from tests.integration.test_conversations import chat

pytestmark = pytest.mark.faults

ROWS = 60
# How long Postgres stays down: the workers, the feeder and the advancer must ride it out.
PG_DOWNTIME_S = 2.0
# Answers are rarely cut at this length on the simulator: most conversations reach their
# last turn, a few end truncated.
MAX_NEW_TOKENS = 1024
# FLUSHALL when the queue holds messages, as one step: returns how many it dropped.
FLUSH_IF_QUEUED = """
local n = redis.call('LLEN', KEYS[1])
if n > 0 then redis.call('FLUSHALL') end
return n
"""


def test_kill_9_workers_and_the_advancer_mid_conversations_loses_and_duplicates_no_turn(
    fast_settings: Settings, repo: Repository, fleet: Fleet, tmp_path: Path
) -> None:
    """Two kills hit the worker holding the advancer's lock while turns wait for their next,
    one hits another worker; the lock lapses, another worker advances, leases expire."""
    started = time.monotonic()
    points = _enqueue(fast_settings, tmp_path)
    fleet.start()
    fleet.start()
    orphans: list[int] = []
    holders_killed = 0
    for share, whom in ((0.15, "advancer"), (0.35, "other"), (0.55, "advancer")):
        victim = _victim(repo, fleet, int(share * points), whom)
        holders_killed += whom == "advancer"
        fleet.kill(victim)
        orphans += running_on(repo, victim)
        fleet.start()
    wait_settled(repo, fleet, timeout_s=150)
    facts = _assert_every_turn_once_and_on_policy(repo, fleet)
    assert orphans, "no kill caught a turn running: the test exercised nothing"
    report(
        "conversations, kill -9",
        holders_killed=holders_killed,
        running_at_kills=len(orphans),
        seconds=round(time.monotonic() - started, 1),
        **facts,
        **fleet.reconciler_totals(),
    )


def test_redis_flushed_mid_conversations_loses_and_duplicates_no_turn(
    fast_settings: Settings,
    repo: Repository,
    fleet: Fleet,
    private_redis: PrivateRedis,
    tmp_path: Path,
) -> None:
    """FLUSHALL twice while turns wait for their next and messages wait in the queue: the
    messages, slots, heartbeats and the advancer's lock vanish; Postgres rebuilds them."""
    started = time.monotonic()
    points = _enqueue(fast_settings, tmp_path)
    fleet.start()
    fleet.start()
    client = redis.Redis.from_url(private_redis.url)
    flush_if_queued = client.register_script(FLUSH_IF_QUEUED)
    lost = []
    try:
        for share in (0.25, 0.5):
            done = int(share * points)

            def flushed(done: int = done) -> int:
                """Messages lost by a flush made while ``done`` turns are done, a turn waits
                and messages are queued; 0 when not flushed."""
                if not _turns_wait(repo, done):
                    return 0
                # Messages sit in the list only between the feeder's publish and a
                # worker's fetch: look often, and flush in the same step as the look.
                for _ in range(50):
                    if n := int(flush_if_queued(keys=[fast_settings.queue])):
                        return n
                    time.sleep(0.005)
                return 0

            lost.append(
                wait_for(
                    flushed, 120, f"{done} done turns, one waiting, messages queued", fleet.tails
                )
            )
    finally:
        client.close()
    wait_settled(repo, fleet, timeout_s=150, supervise=True)
    facts = _assert_every_turn_once_and_on_policy(repo, fleet)
    report(
        "conversations, redis flushed",
        messages_lost=lost,
        crashed_workers=fleet.crashed,
        seconds=round(time.monotonic() - started, 1),
        **facts,
        **fleet.reconciler_totals(),
    )
    assert not fleet.crashed, f"{fleet.crashed} died of the flush\n{fleet.tails()}"


def test_postgres_restarted_mid_conversations_loses_and_duplicates_no_turn(
    own_services_run: OwnServicesRun, private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    """Postgres stopped and started while turns wait for their next and turns run: every
    connection is cut, the advancer's pass and the turns' records among them; the workers
    reconnect, leases expire, and each turn's job still comes into being once."""
    started = time.monotonic()
    settings, repo, fleet = own_services_run
    points = _enqueue(settings, tmp_path)
    fleet.start()
    fleet.start()
    done = int(0.3 * points)

    def mid_run() -> list[int] | None:
        running = repo.job_ids(state=JobState.RUNNING)
        return running if _turns_wait(repo, done) and running else None

    running = wait_for(mid_run, 120, f"{done} done turns, one waiting, one running", fleet.tails)
    private_postgres.stop()
    time.sleep(PG_DOWNTIME_S)
    private_postgres.start()
    wait_settled(repo, fleet, timeout_s=150)
    facts = _assert_every_turn_once_and_on_policy(repo, fleet)
    assert all(w.running() for w in fleet.workers), fleet.tails()
    outages = fleet.log_count("database unreachable")
    assert outages, f"no worker noticed the outage: the test exercised nothing\n{fleet.tails()}"
    report(
        "conversations, postgres restarted",
        running_at_stop=len(running),
        outages_logged=outages,
        tasks_failed_on_db=fleet.log_count("raised unexpected: OperationalError"),
        seconds=round(time.monotonic() - started, 1),
        **facts,
        **fleet.reconciler_totals(),
    )


def _enqueue(settings: Settings, tmp_path: Path) -> int:
    """Enqueue ROWS conversations of three or four user turns, templated with the bundled
    tokenizer as `eaglegen enqueue` does; their answer points in all."""
    rows = []
    for i in range(ROWS):
        asked = [f"Row {i}: name a number.", "Seven.", "Double it?", "Fourteen.", "Halve that?"]
        if i % 2:
            asked += ["Seven again.", "And now?"]
        rows.append(chat(*asked))
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    stats = enqueue_file(settings, path, max_new_tokens=MAX_NEW_TOKENS, turns="all")
    assert stats.conversations == ROWS, stats
    return stats.conversation_turns


def _turns_wait(repo: Repository, done: int) -> bool:
    """Whether ``done`` turns are done and some conversation waits for its next turn."""
    return state_counts(repo)["done"] >= done and _conversations(repo)["waiting"] > 0


def _victim(repo: Repository, fleet: Fleet, done: int, whom: str) -> WorkerProcess:
    """Once turns wait (``_turns_wait``): the worker holding the advancer's lock (``whom``
    "advancer") or, of the others, the ``busiest`` ("other")."""

    def ready() -> WorkerProcess | None:
        holder = _advancer_holder(fleet)
        if holder is None or not _turns_wait(repo, done):
            return None
        if whom == "advancer":
            return holder
        others = [w for w in fleet.running() if w is not holder]
        return busiest(repo, others) or (others[0] if others else None)

    return wait_for(ready, 120, f"{done} done turns, one waiting", fleet.tails)


def _advancer_holder(fleet: Fleet) -> WorkerProcess | None:
    """The running worker whose name holds the advancer's lock of the run (its value:
    host:pid; the run's lock is the one the queue's advancer locks have)."""
    assert fleet.settings.broker_url is not None
    prefix = keys.advancer_lock(fleet.settings.queue, 0).rsplit(":", 1)[0]
    with redis.Redis.from_url(fleet.settings.broker_url) as client:
        lock = next(iter(client.scan_iter(match=f"{prefix}:*")), None)
        owner = None if lock is None else client.get(lock)
    if owner is None:
        return None
    pid = int(owner.decode().rsplit(":", 1)[1])
    return next((w for w in fleet.running() if w.pid == pid), None)


def _conversations(repo: Repository) -> Counter[str]:
    """Conversations by state."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            select(Conversation.state, func.count()).group_by(Conversation.state)
        ).all()
    return Counter({str(state): int(n) for state, n in rows})


def _assert_every_turn_once_and_on_policy(repo: Repository, fleet: Fleet) -> dict[str, Any]:
    """The audit passes (turns 0..n-1 per conversation, states and reasons consistent, the
    counters and ledger exact); there are as many turn jobs as the conversations say, one
    generation per done job; and each turn's prompt is the history with the model's own
    earlier answers, rendered by the run's template. Facts for the report."""
    problems = repo.audit(lease_grace_s=0)
    assert problems == [], f"{problems}\n{fleet.tails()}"
    with repo.engine.connect() as conn:
        conversations = conn.execute(
            select(
                Conversation.id, Conversation.state, Conversation.turns, Conversation.points
            ).add_columns(Conversation.ended_reason)
        ).all()
        turns = conn.execute(
            select(Job.conversation_id, Job.turn, Job.state, Job.input_ids, Job.messages)
            .add_columns(Generation.output_ids)
            .outerjoin(Generation, Generation.job_id == Job.id)
            .where(Job.conversation_id.is_not(None))
            .order_by(Job.conversation_id, Job.turn)
        ).all()
        generations = int(conn.scalar(select(func.count()).select_from(Generation)) or 0)
    states = Counter(c.state for c in conversations)
    assert set(states) <= {"done", "ended"}, states
    assert all(c.ended_reason for c in conversations if c.state == "ended"), conversations
    assert len(turns) == sum(c.turns for c in conversations)
    assert generations == sum(t.state == "done" for t in turns)

    hf = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    by_conversation: dict[int, list[Any]] = {}
    for t in turns:
        by_conversation.setdefault(t.conversation_id, []).append(t)
    for history in by_conversation.values():
        for turn in history:
            messages = turn.messages["messages"]
            answers = [m["content"] for m in messages if m["role"] == "assistant"]
            assert len(answers) == turn.turn, (turn.conversation_id, turn.turn, messages)
            for earlier, answer in zip(history, answers, strict=False):
                written = hf.decode(list(earlier.output_ids), skip_special_tokens=False)
                assert answer.strip() in written, (turn.conversation_id, turn.turn)
            rendered = hf.apply_chat_template(
                messages, tools=turn.messages["tools"], add_generation_prompt=True, tokenize=False
            )
            assert list(turn.input_ids) == hf.encode(rendered, add_special_tokens=False)
    return {
        "conversations": dict(states),
        "ended": dict(Counter(c.ended_reason for c in conversations if c.ended_reason)),
        "turns": len(turns),
        "points": sum(c.points for c in conversations),
    }
