"""The export of on-policy conversations (issue 30) against real Postgres: one row per turn,
a prefix-consistent conversation merged into one row (``--merge-turns``), a conversation as
one conversation row (``--format conversations``), the split by conversation, and
incremental exports of conversations under way.

Two sources of conversations, for two families (Kimi-K2's template keeps earlier reasoning
in the history, Qwen3's drops it):

- a real worker against the simulator (``generated``): ids sampled at random, so whether a
  conversation is prefix-consistent is found from the database by the test, independently;
- answers written by the test (``answered``): each turn claimed and recorded through the
  repository with the tokenizer's own ids of a known text, and the next turn made by the
  worker's advancer (``worker.advancer``), as a worker does, so that the rows are known
  exactly: Kimi-K2's conversations are prefix-consistent, Qwen3's are not.

Every row is compared with the database read directly (jobs and generations).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from transformers import AutoTokenizer

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from exporter.export import ExportRequest, ExportResult, prepare, run_export
from exporter.layouts import CONVERSATIONS, SPECULATORS, layout_for
from exporter.manifest import Options
from exporter.merge import PREFIX_DIFFERS
from exporter.rows import TRUNCATED, Filters
from exporter.split import TRAIN, VAL
from models.records import GenerationRecord
from models.repository import Repository
from models.schema import Conversation, Generation, Job
from tests.helpers import enqueue_file, write_jsonl
from tests.integration.test_conversations import FAST, chat, wait_conversations
from tests.integration.test_export import parquet_rows, shard_files
from tests.integration.test_export_conversations import TOOLS
from tests.integration.test_export_layouts import saved
from tests.integration.test_families_end_to_end import tokenizer_folder
from tests.workers import in_thread_worker
from worker.advancer import Advancer

# Multi-turn rows (conversations of 2 and 3 turns) and one single-turn row (a plain job).
ROWS = [
    chat("Name a prime.", "7.", "Another one?", "11.", "And their sum?", "18."),
    chat("Capital of France?", "Paris.", "Of Italy?"),
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            *chat("Hi", "Hello!", "Bye")["messages"],
        ]
    },
    chat("A single question."),
]
# More conversations for the split: each goes to one split, about half of them to val.
MANY = ROWS + [chat(f"Count to {n}.", "Done.", f"And back from {n}?") for n in range(12)]
# A conversation whose first answer calls a tool, the row's result following: the test's
# answer calls it as the row did, so the conversation goes on after the result.
TOOL_ROW = {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "Sunny."},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks!"},
    ],
    "tools": TOOLS,
}
# How each family's model writes an answer after its generation prompt: reasoning opened
# (unless the prompt opened it), closed, the answer or a call, the stop.
WRITTEN = {
    "kimi_k2": {
        "open": "<think>",
        "close": "</think>",
        "call": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "stop": "<|im_end|>",
    },
    "qwen3": {
        "open": "<think>\n",
        "close": "\n</think>\n\n",
        "call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "stop": "<|im_end|>",
    },
}


def export(
    repo: Repository,
    out: Path,
    *,
    consumer: str = "hf",
    row_format: str | None = None,
    merge_turns: bool = False,
    filters: Filters | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    incremental: bool = False,
    jsonl: bool = False,
) -> ExportResult:
    """One export pass, as `eaglegen export` runs it."""
    layout = layout_for(consumer, row_format, jsonl=jsonl)
    options = Options(
        layout.writer,
        filters or Filters(),
        val_fraction,
        seed,
        format=layout.format,
        style=layout.style,
        consumer=layout.consumer,
        merge_turns=merge_turns,
    )
    request = ExportRequest("run", out, options, 256_000_000, incremental)
    found, previous, _ = prepare(repo, request)
    return run_export(repo, request, found, previous)


def rows_of(out: Path, manifest: dict[str, Any], split: str | None = None) -> list[dict[str, Any]]:
    """Every row the manifest lists (of ``split``), whatever the writer."""
    found = []
    for name in shard_files(manifest, split):
        if name.endswith(".parquet"):
            found += parquet_rows(out, [name])
        else:
            lines = (out / name).read_text().splitlines()
            found += [_flat(json.loads(line)) for line in lines]
    return found


def _flat(line: dict[str, Any]) -> dict[str, Any]:
    return line | line["metadata"] if "input_ids" in line else line


def database(repo: Repository) -> tuple[dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The done turns of every conversation (in turn order) and the done plain jobs, read
    directly: job id, turn, prompt and output ids, stored messages, finish."""
    with repo.engine.connect() as conn:
        found = conn.execute(
            select(
                Job.id,
                Job.conversation_id,
                Job.turn,
                Job.input_ids,
                Job.messages,
                Generation.output_ids,
                Generation.finish_type,
            )
            .join(Generation, Generation.job_id == Job.id)
            .where(Job.state == "done")
            .order_by(Job.conversation_id, Job.turn, Job.id)
        ).all()
    conversations: dict[int, list[dict[str, Any]]] = {}
    plain = []
    for r in found:
        row = {**r._asdict(), "input_ids": list(r.input_ids), "output_ids": list(r.output_ids)}
        if r.conversation_id is None:
            plain.append(row)
        else:
            conversations.setdefault(r.conversation_id, []).append(row)
    return conversations, plain


def prefix_consistent(turns: list[dict[str, Any]]) -> bool:
    """Whether every turn's prompt starts with the turn before it's prompt + output."""
    return all(
        b["input_ids"][: len(a["input_ids"]) + len(a["output_ids"])]
        == a["input_ids"] + a["output_ids"]
        for a, b in itertools.pairwise(turns)
    )


def merged_mask(turns: list[dict[str, Any]]) -> list[int]:
    """1 over each turn's output in the last turn's prompt + output, 0 elsewhere."""
    last = turns[-1]
    mask = [0] * (len(last["input_ids"]) + len(last["output_ids"]))
    for t in turns:
        start = len(t["input_ids"])
        mask[start : start + len(t["output_ids"])] = [1] * len(t["output_ids"])
    return mask


def assert_turn_rows(rows: list[dict[str, Any]], repo: Repository) -> None:
    """One row per done job: a turn named ``<conversation>_turn<t>``, a plain job by its
    id; its ids the job's prompt then its output, its mask 0 then 1 where the output
    begins."""
    conversations, plain = database(repo)
    expected = {str(j["id"]): j for j in plain}
    for c, turns in conversations.items():
        expected |= {f"{c}_turn{t['turn']}": t for t in turns}
    assert sorted(r["id"] for r in rows) == sorted(expected)
    for row in rows:
        job = expected[row["id"]]
        assert row["job_id"] == job["id"]
        assert (row["conversation_id"], row["turn"], row["turns"]) == (
            job["conversation_id"],
            job["turn"],
            1,
        )
        assert row["input_ids"] == job["input_ids"] + job["output_ids"]
        assert row["loss_mask"] == [0] * len(job["input_ids"]) + [1] * len(job["output_ids"])


def assert_merged_rows(rows: list[dict[str, Any]], repo: Repository) -> tuple[int, int]:
    """A prefix-consistent conversation is one row, its last turn's ids trained over every
    turn's output; the others one row per turn; plain jobs as ever. How many conversations
    were merged, and how many turns stayed apart."""
    conversations, plain = database(repo)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows)
    expected = {str(j["id"]) for j in plain}
    merged = apart = 0
    for c, turns in conversations.items():
        last = turns[-1]
        if prefix_consistent(turns):
            merged += 1
            name = f"{c}_turn0" if last["turn"] == 0 else f"{c}_turn0-{last['turn']}"
            row = by_id[name]
            assert row["input_ids"] == last["input_ids"] + last["output_ids"]
            assert row["loss_mask"] == merged_mask(turns)
            assert sum(row["loss_mask"]) == sum(len(t["output_ids"]) for t in turns)
            assert (row["job_id"], row["conversation_id"], row["turns"]) == (
                last["id"],
                c,
                len(turns),
            )
            expected.add(name)
        else:
            apart += len(turns)
            for t in turns:
                row = by_id[f"{c}_turn{t['turn']}"]
                assert row["input_ids"] == t["input_ids"] + t["output_ids"]
                assert sum(row["loss_mask"]) == len(t["output_ids"]) and row["turns"] == 1
                expected.add(f"{c}_turn{t['turn']}")
    assert set(by_id) == expected
    return merged, apart


def assert_split_by_conversation(out: Path, manifest: dict[str, Any]) -> dict[int, str]:
    """No conversation has rows in both splits; each conversation's split."""
    splits: dict[int, set[str]] = {}
    for split in (TRAIN, VAL):
        for row in rows_of(out, manifest, split):
            if row["conversation_id"] is not None:
                splits.setdefault(row["conversation_id"], set()).add(split)
    assert all(len(s) == 1 for s in splits.values()), splits
    return {c: next(iter(s)) for c, s in splits.items()}


@pytest.fixture(params=["kimi_k2", "qwen3"])
def family(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(request.param)


def generated(settings: Settings, repo: Repository, folder: Path, path: Path) -> None:
    """Conversations of ``path`` answered by a real worker against the simulator."""
    with SimServer(SimConfig(tokenizer_dir=folder, **FAST)) as sim:
        served = settings.model_copy(
            update={"servers": [ServerSpec(name="sim", url=sim.url)], "worker_concurrency": 8}
        )
        enqueue_file(served, path, tokenizer=folder, max_new_tokens=400, turns="all")
        with in_thread_worker(served):
            wait_conversations(repo, conversation_dataset(repo))


def conversation_dataset(repo: Repository) -> int:
    with repo.engine.connect() as conn:
        return int(conn.scalar(select(Conversation.dataset_id).limit(1)))


class Answering:
    """The model, written by the test: each queued turn claimed and recorded through the
    repository with the tokenizer's own ids of a known answer, then the worker's advancer
    makes the next turns. ``answers``: what each job's answer says, by job id."""

    def __init__(self, repo: Repository, folder: Path, family: str) -> None:
        self.repo = repo
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.written = WRITTEN[family]
        self.advancer = Advancer(repo, hold=lambda _run: True, release=lambda _run: None)
        self.answers: dict[int, tuple[str, str, bool]] = {}

    def step(self) -> int:
        """Answer every queued turn, then advance; how many turns were answered."""
        with self.repo.engine.connect() as conn:
            queued = conn.execute(
                select(Job.id, Job.messages, Job.opens_reasoning, Job.prompt_tokens)
                .where(Job.state == "queued")
                .order_by(Job.id)
            ).all()
        for job in queued:
            ids = self._answer(job.id, job.messages["messages"], job.opens_reasoning)
            assert self.repo.claim(job.id, "w", lease_seconds=60).job is not None
            record = GenerationRecord(ids, "stop", None, job.prompt_tokens, len(ids), 0, 0.1, "t")
            assert self.repo.record(job.id, "w", record)
        self.advancer.advance()
        return len(queued)

    def run(self, most_turns: int = 10) -> None:
        """Until no turn is left to answer; fails if turns still come after ``most_turns``
        rounds (no row here has that many)."""
        for _ in range(most_turns):
            if not self.step():
                return
        raise AssertionError(f"turns still queued after {most_turns} rounds")

    def _answer(self, job_id: int, messages: list[dict[str, Any]], opens: bool) -> list[int]:
        w = self.written
        reasoning = f"Thinking about job {job_id}."
        calls = messages[-1]["content"] == "Weather in Oslo?"
        answer = "" if calls else f"Answer {job_id}."
        text = ("" if opens else w["open"]) + reasoning + w["close"] + answer
        text += (w["call"] if calls else "") + w["stop"]
        self.answers[job_id] = (reasoning, answer, calls)
        return list(self.tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.fixture
def answered(settings: Settings, repo: Repository, family: str, tmp_path: Path) -> Answering:
    """ROWS and TOOL_ROW enqueued for ``family`` and answered by the test to the end."""
    folder = tokenizer_folder(tmp_path / "tok", family)
    path = write_jsonl(tmp_path / "chats.jsonl", [*ROWS, TOOL_ROW])
    enqueue_file(settings, path, tokenizer=folder, max_new_tokens=400, turns="all")
    return Answering(repo, folder, family)


def test_turn_rows_and_merged_rows_of_a_simulated_run_are_the_database(
    settings: Settings, repo: Repository, family: str, tmp_path: Path
) -> None:
    folder = tokenizer_folder(tmp_path / "tok", family)
    generated(settings, repo, folder, write_jsonl(tmp_path / "chats.jsonl", MANY))
    conversations, plain = database(repo)
    assert len(conversations) == len(MANY) - 1 and len(plain) == 1

    per_turn = export(repo, tmp_path / "turns", val_fraction=0.5, seed=3)
    rows = rows_of(tmp_path / "turns", per_turn.manifest)
    assert_turn_rows(rows, repo)
    assert per_turn.manifest["rows"] == len(plain) + sum(len(t) for t in conversations.values())
    assert "conversations" not in per_turn.manifest["counts"]["d"]
    turn_splits = assert_split_by_conversation(tmp_path / "turns", per_turn.manifest)
    assert set(turn_splits.values()) == {TRAIN, VAL}

    merged = export(repo, tmp_path / "merged", merge_turns=True, val_fraction=0.5, seed=3)
    found = merged.manifest["counts"]["d"]["conversations"]
    n_merged, n_apart = assert_merged_rows(rows_of(tmp_path / "merged", merged.manifest), repo)
    assert (found["read"], found["merged"]) == (len(conversations), n_merged)
    assert found["unmerged_turns"] == ({PREFIX_DIFFERS: n_apart} if n_apart else {})
    assert merged.manifest["counts"]["d"]["read"] == per_turn.manifest["counts"]["d"]["read"]
    assert merged.manifest["conversation_turns_under_way"] == {}
    # The same conversation in the same split, merged or not.
    assert assert_split_by_conversation(tmp_path / "merged", merged.manifest) == turn_splits
    if family == "qwen3":
        # Its template drops the earlier turns' reasoning: no two-turn prefix holds.
        assert n_merged == 0 and n_apart == sum(len(t) for t in conversations.values())


def test_answers_known_to_the_test_merge_where_the_template_keeps_the_history(
    answered: Answering, repo: Repository, family: str, tmp_path: Path
) -> None:
    answered.run()
    conversations, plain = database(repo)
    with repo.engine.connect() as conn:
        states = dict(conn.execute(select(Conversation.id, Conversation.state)).all())
    assert set(states.values()) == {"done"} and len(conversations) == 4
    assert sorted(len(t) for t in conversations.values()) == [2, 2, 3, 3]

    result = export(repo, tmp_path / "merged", merge_turns=True, jsonl=True)
    rows = rows_of(tmp_path / "merged", result.manifest)
    n_merged, n_apart = assert_merged_rows(rows, repo)
    counts = result.manifest["counts"]["d"]
    if family == "kimi_k2":  # the history is written as generated: every prefix holds
        assert (n_merged, n_apart) == (4, 0)
        assert len(rows) == 4 + len(plain)
        assert counts["conversations"]["merged_turns"] == 10
    else:  # Qwen3 drops the reasoning of turns before the last user message
        assert (n_merged, n_apart) == (0, 10)
        assert counts["conversations"]["unmerged"] == {PREFIX_DIFFERS: 4}
    assert counts["read"] == 10 + len(plain) and counts["exported"] == len(rows)

    # The exact ids in speculators' layout too: a torch Dataset whose ids are strings.
    out = tmp_path / "speculators"
    export(repo, out, consumer=SPECULATORS, merge_turns=True)
    assert_merged_rows(saved(out / "train"), repo)


def test_a_conversation_row_holds_every_turn_decoded_and_round_trips(
    answered: Answering, repo: Repository, family: str, tmp_path: Path
) -> None:
    answered.run()
    conversations, plain = database(repo)
    out = tmp_path / "conv"
    result = export(repo, out, row_format=CONVERSATIONS)
    rows = rows_of(out, result.manifest)
    assert len(rows) == len(conversations) + len(plain)
    by_id = {r["id"]: r for r in rows}
    for c, turns in conversations.items():
        last = turns[-1]
        row = by_id[f"{c}_turn0-{last['turn']}"]
        meta = row["metadata"]
        assert (meta["conversation_id"], meta["turns"], meta["job_ids"]) == (
            c,
            len(turns),
            [t["id"] for t in turns],
        )
        assert meta["job_id"] == last["id"] and meta["conversation_state"] == "done"
        # Every assistant message is the model's, decoded from its exact ids: the answers
        # the test wrote, in order, each with its reasoning and its call.
        said = [m for m in row["conversations"] if m["role"] == "assistant"]
        assert len(said) == len(turns)
        for message, t in zip(said, turns, strict=True):
            reasoning, answer, calls = answered.answers[t["id"]]
            assert (message["reasoning_content"], message["content"].strip()) == (
                reasoning,
                answer,
            )
            if calls:
                [call] = message["tool_calls"]
                assert call["function"]["name"] == "get_weather"
                arguments = call["function"]["arguments"]
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                assert arguments == {"city": "Oslo"}
            else:
                assert "tool_calls" not in message
        # The row's user and tool messages are the row's, in order.
        others = [m["content"] for m in row["conversations"] if m["role"] in ("user", "tool")]
        stored = [
            m["content"] for m in last["messages"]["messages"] if m["role"] in ("user", "tool")
        ]
        assert others == stored
        # The round trip: the whole conversation re-templated is the last turn's recorded
        # prompt + output ids (exact up to the template's turn suffix).
        assert meta["roundtrip_exact"] is True, meta
    trips = result.manifest["roundtrip"]["d"]
    assert trips["checked"] == trips["exact"] == len(rows)
    assert result.manifest["counts"]["d"]["conversations"]["merged"] == len(conversations)
    # SpecForge is told how to train every turn of them.
    usage = export(repo, tmp_path / "sf", consumer="specforge", row_format=CONVERSATIONS).usage
    assert "train_only_last_turn: false trains them all" in usage


def test_incremental_exports_add_later_turns_and_conversations_once_they_end(
    answered: Answering, repo: Repository, family: str, tmp_path: Path
) -> None:
    answered.step()  # every first turn answered, every second one made
    turns_out, merged_out = tmp_path / "turns", tmp_path / "merged"
    first_turns = export(repo, turns_out, val_fraction=0.5, seed=5).manifest
    first_merged = export(repo, merged_out, merge_turns=True, val_fraction=0.5, seed=5).manifest
    conversations, plain = database(repo)
    assert first_turns["rows"] == len(conversations) + len(plain)  # each conversation's turn 0
    # Merged: only the plain job; the conversations are under way, their turns counted.
    assert first_merged["rows"] == len(plain)
    assert first_merged["conversation_turns_under_way"] == {"d": len(conversations)}
    first_splits = assert_split_by_conversation(turns_out, first_turns)

    answered.run()
    second_turns = export(repo, turns_out, val_fraction=0.5, seed=5, incremental=True).manifest
    second_merged = export(
        repo, merged_out, merge_turns=True, val_fraction=0.5, seed=5, incremental=True
    ).manifest
    assert_turn_rows(rows_of(turns_out, second_turns), repo)  # every turn once
    assert_merged_rows(rows_of(merged_out, second_merged), repo)  # every conversation once
    assert second_merged["conversation_turns_under_way"] == {}
    assert len(second_merged["resume"]["conversations"]) == 4
    # The later turns went where their conversation's first turn went.
    splits = assert_split_by_conversation(turns_out, second_turns)
    assert {c: splits[c] for c in first_splits} == first_splits
    assert assert_split_by_conversation(merged_out, second_merged) == splits
    # Nothing new: nothing added.
    third = export(
        repo, merged_out, merge_turns=True, val_fraction=0.5, seed=5, incremental=True
    ).manifest
    assert third["passes"][-1]["rows"] == 0 and third["rows"] == second_merged["rows"]


def cut(repo: Repository, job_id: int) -> None:
    """Mark a generation as cut at max_new_tokens (what --exclude-truncated removes)."""
    with repo.engine.begin() as conn:
        conn.execute(
            update(Generation).where(Generation.job_id == job_id).values(finish_type="length")
        )


def test_a_turn_a_filter_removes_ends_the_row_before_it_or_leaves_the_rest_apart(
    answered: Answering, repo: Repository, family: str, tmp_path: Path
) -> None:
    """A removed last turn (a cut answer, which ends its conversation): the turns before it
    still make the row. A removed turn with kept turns after it: those stay one row per
    turn (reason ``filtered``), in both formats."""
    answered.run()
    conversations, _ = database(repo)
    a, b = [c for c, turns in conversations.items() if len(turns) == 3]
    cut(repo, conversations[a][-1]["id"])
    cut(repo, conversations[b][1]["id"])
    filters = Filters(exclude_truncated=True)

    result = export(repo, tmp_path / "tokens", merge_turns=True, filters=filters)
    counts = result.manifest["counts"]["d"]
    assert counts["removed"][TRUNCATED] == 2
    assert counts["conversations"]["unmerged"].get("filtered") == 1
    rows = {r["id"]: r for r in rows_of(tmp_path / "tokens", result.manifest)}
    kept = conversations[a][:2]
    if family == "kimi_k2":
        row = rows[f"{a}_turn0-1"]
        assert row["input_ids"] == kept[-1]["input_ids"] + kept[-1]["output_ids"]
        assert row["loss_mask"] == merged_mask(kept)
    else:
        assert {f"{a}_turn0", f"{a}_turn1"} <= set(rows)
    assert not {f"{a}_turn2", f"{b}_turn1"} & set(rows)
    for t in (conversations[b][0], conversations[b][2]):
        row = rows[f"{b}_turn{t['turn']}"]
        assert row["input_ids"] == t["input_ids"] + t["output_ids"] and row["turns"] == 1

    # --only-valid reads each turn (every answer here is valid): the same rows.
    valid = Filters(exclude_truncated=True, only_valid=True)
    again = export(repo, tmp_path / "valid", merge_turns=True, filters=valid)
    assert sorted(r["id"] for r in rows_of(tmp_path / "valid", again.manifest)) == sorted(rows)

    chats = export(repo, tmp_path / "conv", row_format=CONVERSATIONS, filters=filters)
    lines = {r["id"]: r for r in rows_of(tmp_path / "conv", chats.manifest)}
    assert f"{a}_turn0-1" in lines and f"{b}_turn0" in lines and f"{b}_turn2" in lines
    said = [m for m in lines[f"{a}_turn0-1"]["conversations"] if m["role"] == "assistant"]
    assert len(said) == 2  # turns 0 and 1: the cut turn 2 is left out
    assert lines[f"{b}_turn2"]["metadata"]["job_id"] == conversations[b][2]["id"]
    assert chats.manifest["counts"]["d"]["conversations"]["unmerged_turns"] == {"filtered": 2}
