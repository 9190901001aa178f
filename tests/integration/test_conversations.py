"""On-policy conversations (issue 30): a multi-turn row of a ``turns = "all"`` dataset is
answered turn by turn by a real worker against the simulator, each later turn's prompt made
of the model's own earlier answers, for two families' real chat templates and tokens.

What a turn's prompt must be is checked against transformers' own ``apply_chat_template``
on the messages stored with the turn, and those messages against the row (its user turns,
in order) and the model's exact output (each earlier answer's text is in what it wrote).
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select, text
from transformers import AutoTokenizer

from core.dialogue import FAILED, TOO_LONG, TOOL_DIVERGENCE, TRUNCATED, answer_points
from core.settings import ServerSpec, Settings
from eaglegen.report.status import status_document, status_view
from eaglegen.sim import SimConfig, SimServer
from models.conversations import ConversationCounts, NextTurn
from models.repository import Repository
from models.schema import Conversation, Dataset, Generation, Job, Run
from tests.helpers import enqueue_file, wait_settled, write_jsonl
from tests.integration.test_families_end_to_end import tokenizer_folder
from tests.integration.test_families_pipeline import stats_document
from tests.unit.test_sim_tools import tool_rows
from tests.workers import EACH_ENGINE, in_thread_worker

pytestmark = EACH_ENGINE

FAST: dict[str, Any] = {
    "decode_step_ms": 0.2,
    "decode_ms_per_request": 0.0,
    "mean_output_tokens": 30,
    "max_output_tokens": 120,
}


def chat(*turns: str) -> dict[str, Any]:
    """A row of alternating user and assistant messages (the dataset's answers)."""
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]}


ROWS = [
    chat("Name a prime.", "7.", "Another one?", "11.", "And their sum?", "18."),
    chat("Capital of France?", "Paris.", "Of Italy?"),
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *chat("Hi", "Hello!", "Bye")["messages"],
        ]
    },
    chat("A single question."),  # one answer point: a job of its own
]


@pytest.fixture(params=["kimi_k2", "qwen3"])
def family(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The family's test tokenizer folder (its real chat template and special tokens)."""
    return tokenizer_folder(tmp_path / "tok", str(request.param))


@pytest.fixture
def served(settings: Settings, family: Path) -> Iterator[Settings]:
    with SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim:
        yield settings.model_copy(
            update={"servers": [ServerSpec(name="sim", url=sim.url)], "worker_concurrency": 8}
        )


def wait_conversations(
    repo: Repository, dataset_id: int, timeout_s: float = 120
) -> ConversationCounts:
    """Wait until every conversation is done or ended and no job is open; the dataset's."""
    wait_settled(repo, timeout_s)
    return repo.conversation_counts([dataset_id])[dataset_id]


def turns_of(repo: Repository) -> dict[int, list[dict[str, Any]]]:
    """Every conversation's turns in order: input ids, stored messages and output ids."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            select(
                Job.id.label("job_id"),
                Job.conversation_id,
                Job.turn,
                Job.input_ids,
                Job.messages,
                Job.state,
            )
            .add_columns(Generation.output_ids, Generation.finish_type)
            .outerjoin(Generation, Generation.job_id == Job.id)
            .where(Job.conversation_id.is_not(None))
            .order_by(Job.conversation_id, Job.turn)
        ).all()
    found: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        found.setdefault(r.conversation_id, []).append(r._asdict())
    return found


def dataset_id(repo: Repository) -> int:
    with repo.engine.connect() as conn:
        return int(conn.scalar(select(Conversation.dataset_id).limit(1)))


def test_every_turn_is_answered_after_the_models_own_earlier_answers(
    served: Settings, family: Path, repo: Repository, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", ROWS)
    stats = enqueue_file(served, path, tokenizer=family, max_new_tokens=400, turns="all")
    assert (stats.accepted, stats.conversations, stats.conversation_turns) == (4, 3, 3 + 2 + 2)
    with in_thread_worker(served):
        counts = wait_conversations(repo, dataset_id(repo))
    assert counts.by_state == {"done": 3}, counts
    assert counts.turns_created == 7
    [status] = repo.status().datasets
    assert (status.turns, status.conversations, status.turns_to_come) == ("all", {"done": 3}, 0)
    assert status.states["done"] == 1 + 7

    hf = AutoTokenizer.from_pretrained(str(family), local_files_only=True)
    conversations = turns_of(repo)
    assert sorted(len(t) for t in conversations.values()) == [2, 2, 3]
    for turns in conversations.values():
        assert all(t["state"] == "done" for t in turns)
        for t, turn in enumerate(turns):
            stored = json.loads(json.dumps(turn["messages"]))
            expected = hf.apply_chat_template(
                stored["messages"],
                tools=stored["tools"],
                add_generation_prompt=True,
                tokenize=False,
            )
            assert list(turn["input_ids"]) == hf.encode(expected, add_special_tokens=False)
            answers = [m for m in stored["messages"] if m["role"] == "assistant"]
            assert len(answers) == t  # every earlier answer is the model's, none the row's
            for earlier, answer in zip(turns, answers, strict=False):
                written = hf.decode(list(earlier["output_ids"]), skip_special_tokens=False)
                assert answer["content"].strip() in written
    # stats: the conversations, the median completion by turn index, and the later turns
    # whose prompt starts with the turn before's prompt and output (counted here apart).
    extending = sum(
        1
        for turns in conversations.values()
        for before, after in itertools.pairwise(turns)
        if list(after["input_ids"][: len(before["input_ids"]) + len(before["output_ids"])])
        == [*before["input_ids"], *before["output_ids"]]
    )
    [conv] = stats_document(repo, "run")["conversations"]
    assert conv["states"] == {"done": 3}
    assert (conv["later_turns"], conv["extending"]) == (4, extending)
    assert [t["turn"] for t in conv["completion_by_turn"]] == [0, 1, 2]
    assert sum(conv["departing_sample"].values()) == 4 - extending
    # show: a turn of a conversation shows the whole conversation, turn by turn.
    job = turns_of(repo)[next(iter(conversations))][1]
    shown = show_json(served, job["job_id"])
    assert [s["turn"] for s in shown["samples"]] == list(
        range(len(conversations[next(iter(conversations))]))
    )
    # The row's own user turns come in order, whatever the model answered.
    [longest] = [t for t in conversations.values() if len(t) == 3]
    users = [m["content"] for m in longest[2]["messages"]["messages"] if m["role"] == "user"]
    assert users == ["Name a prime.", "Another one?", "And their sum?"]


def test_a_cut_answer_a_diverging_call_and_a_prompt_too_long_end_their_conversation(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    family = tokenizer_folder(tmp_path / "tok", "kimi_k2")
    chats = write_jsonl(tmp_path / "chats.jsonl", ROWS[:3])
    # Rows whose answer calls a tool, its results following: the simulator's calls are not
    # the row's, so each conversation ends after its first turn.
    called = [r for r in tool_rows() if _results_follow_a_call(r["messages"])]
    assert called, "the sample dataset has rows with tool results"
    tools = write_jsonl(tmp_path / "tools.jsonl", called)
    hf = AutoTokenizer.from_pretrained(str(family), local_files_only=True)
    first = max(
        len(hf.encode(text, add_special_tokens=False))
        for r in ROWS
        for text in [
            hf.apply_chat_template(
                r["messages"][: first_point(r)], add_generation_prompt=True, tokenize=False
            )
        ]
    )
    with SimServer(SimConfig(tokenizer_dir=family, **FAST)) as sim:
        served = settings.model_copy(
            update={"servers": [ServerSpec(name="sim", url=sim.url)], "worker_concurrency": 8}
        )
        enqueue_file(served, chats, run="cut", tokenizer=family, max_new_tokens=4, turns="all")
        enqueue_file(served, tools, run="tools", tokenizer=family, max_new_tokens=400, turns="all")
        # Room for every first prompt and its answer, not for a second turn's prompt.
        enqueue_file(
            served,
            chats,
            run="long",
            tokenizer=family,
            max_new_tokens=400,
            turns="all",
            max_context_len=first + 400 + 2,
        )
        with in_thread_worker(served):
            ends = {
                run: wait_conversations(repo, dataset_of(repo, run))
                for run in ("cut", "tools", "long")
            }
    assert ends["cut"].ended_by_reason == {TRUNCATED: 3}, ends["cut"]
    assert ends["tools"].ended_by_reason == {TOOL_DIVERGENCE: len(called)}, ends["tools"]
    assert ends["long"].ended_by_reason == {TOO_LONG: 3}, ends["long"]
    for counts in ends.values():
        assert counts.turns_created == counts.total  # the turns after an end never exist
    # status: the conversations table names each end.
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(status_view(repo.status(), None))
    table = out.export_text()
    assert "conversations (turns = all)" in table
    for reason in (TRUNCATED, TOOL_DIVERGENCE, TOO_LONG):
        assert reason in table, table
    documents = {d["run"]: d for d in status_document(repo.status(), None)["datasets"]}
    assert documents["cut"]["conversations"] == {"ended: truncated": 3, "turns_to_come": 0}
    # The first turn of each stays: the model's answer to an on-policy prompt.
    for turns in turns_of(repo).values():
        assert [t["state"] for t in turns] == ["done"]


def first_point(row: dict[str, Any]) -> int:
    """Where the row's first answer point is: its first turn's prompt is what comes before."""
    return answer_points(row["messages"])[0].start


def _results_follow_a_call(messages: list[dict[str, Any]]) -> bool:
    return any(
        m["role"] == "assistant" and m.get("tool_calls") and n["role"] == "tool"
        for m, n in itertools.pairwise(messages)
    )


def dataset_of(repo: Repository, run: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.scalar(
                select(Dataset.id).join(Run, Run.id == Dataset.run_id).where(Run.name == run)
            )
        )


def test_a_turn_is_created_once_and_a_turn_sent_back_makes_its_conversation_active(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "c.jsonl", ROWS[:1]), turns="all")
    with repo.engine.begin() as conn:
        [conversation] = conn.execute(select(Conversation.id, Conversation.state)).all()
        assert conversation.state == "active"
        # The trigger of migration 0011: a settled latest turn makes it 'waiting'.
        conn.execute(text("UPDATE jobs SET state = 'failed' WHERE turn = 0"))
    assert state_of(repo, conversation.id) == ("waiting", 1)
    job = NextTurn([1, 2, 3], json.dumps({"messages": [], "tools": None}), False)
    # Two advancers deciding the same conversation (or one killed and run again): one job.
    assert repo.settle_conversation(conversation.id, 1, latest="failed", next_turn=job)
    assert not repo.settle_conversation(conversation.id, 1, latest="failed", next_turn=job)
    assert state_of(repo, conversation.id) == ("active", 2)
    with repo.engine.begin() as conn:
        turns = conn.execute(
            select(Job.turn).where(Job.conversation_id == conversation.id).order_by(Job.turn)
        ).scalars()
        assert list(turns) == [0, 1]
        conn.execute(text("UPDATE jobs SET state = 'failed' WHERE turn = 1"))
    assert state_of(repo, conversation.id) == ("waiting", 2)
    # Decided on a read from before the turn was retried and done: nothing happens.
    assert not repo.settle_conversation(conversation.id, 2, latest="done", ended=FAILED)
    assert repo.settle_conversation(conversation.id, 2, latest="failed", ended=FAILED)
    assert state_of(repo, conversation.id) == ("ended", 2)
    # The failed turn retried: its conversation is under way again, its end forgotten.
    with repo.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET state = 'queued' WHERE turn = 1"))
        # An earlier turn moving changes nothing: only the latest turn speaks for it.
        conn.execute(text("UPDATE jobs SET state = 'done' WHERE turn = 0"))
    assert state_of(repo, conversation.id) == ("active", 2)
    assert repo.conversations_under_way("run") == 1


def state_of(repo: Repository, conversation_id: int) -> tuple[str, int]:
    with repo.engine.connect() as conn:
        row = conn.execute(
            select(Conversation.state, Conversation.turns).where(Conversation.id == conversation_id)
        ).one()
    return str(row.state), int(row.turns)


def test_a_next_turn_goes_to_the_server_that_generated_the_turn_before(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = [chat(f"Question {i}?", "A.", "Why?", "B.", "And then?") for i in range(12)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with SimServer(SimConfig(**FAST)) as a, SimServer(SimConfig(**FAST)) as b:
        served = settings.model_copy(
            update={
                "servers": [ServerSpec(name="a", url=a.url), ServerSpec(name="b", url=b.url)],
                "worker_concurrency": 8,
            }
        )
        enqueue_file(served, path, max_new_tokens=400, turns="all")
        with in_thread_worker(served):
            counts = wait_conversations(repo, dataset_id(repo))
    assert counts.by_state == {"done": 12}, counts
    with repo.engine.connect() as conn:
        pairs = conn.execute(
            text("""
            SELECT g.server, p.server FROM jobs j
            JOIN generations g ON g.job_id = j.id
            JOIN jobs pj ON pj.conversation_id = j.conversation_id AND pj.turn = j.turn - 1
            JOIN generations p ON p.job_id = pj.id
            """)
        ).all()
        first = conn.execute(
            text(
                "SELECT g.server FROM jobs j JOIN generations g ON g.job_id = j.id WHERE j.turn = 0"
            )
        ).scalars()
        used = set(first)
    assert len(pairs) == 24
    assert used == {"a", "b"}, used  # the first turns spread over both servers
    # Both servers always had room: every later turn went where its history is cached.
    assert all(server == previous for server, previous in pairs), pairs


def show_json(settings: Settings, job_id: int) -> dict[str, Any]:
    """`eaglegen show JOB --json`, run as a user runs it."""
    import subprocess
    import sys

    assert settings.database_url is not None
    result = subprocess.run(
        [sys.executable, "-m", "eaglegen", "show", str(job_id), "--json"],
        env={**os.environ, "EAGLEGEN_DATABASE_URL": settings.database_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_a_run_whose_tokenizer_is_not_here_is_left_to_another_worker_and_blocks_no_other(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    import shutil

    from eaglegen.assets import TOKENIZER_DIR
    from worker.advancer import Advancer

    elsewhere = shutil.copytree(TOKENIZER_DIR, tmp_path / "elsewhere")
    rows = write_jsonl(tmp_path / "c.jsonl", ROWS[:3])
    enqueue_file(settings, rows, run="away", tokenizer=elsewhere, turns="all")
    enqueue_file(settings, rows, run="here", turns="all")
    shutil.rmtree(elsewhere)  # as on a worker host without that folder
    with repo.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET state = 'failed' WHERE turn = 0"))
    held: list[int] = []
    released: list[int] = []
    advancer = Advancer(repo, hold=lambda run: held.append(run) or True, release=released.append)
    assert advancer.advance() == 3  # run "here" decided, whatever the other holds
    with repo.engine.connect() as conn:
        states = dict(
            conn.execute(
                text("""
                SELECT r.name,
                       string_agg(DISTINCT c.state || ':' || coalesce(c.ended_reason, ''), ',')
                FROM conversations c JOIN datasets d ON d.id = c.dataset_id
                JOIN runs r ON r.id = d.run_id GROUP BY r.name
                """)
            ).all()
        )
    assert states == {"away": "waiting:", "here": "ended:failed"}, states
    [away] = [run for run in held if run in released]  # its lock given up for another host
    assert advancer.advance() == 0 and held.count(away) == 1  # not tried again at once
