"""Enqueue against real Postgres and Redis: exact ids, idempotence, rejected rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from core.broker import Publisher
from core.settings import Settings
from eaglegen.assets import TOKENIZER_DIR
from models.db import make_engine
from models.ledger import BudgetBasis
from models.repository import Repository
from producer.commands import run_enqueue
from producer.plan import DatasetPlan, RunPlan, plan_from_run_file
from producer.runfile import load_run_file
from tests.helpers import enqueue_file, reference_ids, sample_rows, write_jsonl
from worker.feeder import Feeder


def queue_length(settings: Settings) -> int:
    """Messages in Redis after one pass of the feeder (the enqueue itself publishes none):
    one per stored job that has none out yet."""
    url = settings.services().broker_url
    with redis.Redis.from_url(url) as client, Publisher(url, settings.queue) as publisher:
        engine = make_engine(settings.services().database_url, pool_size=1)
        try:
            Feeder(Repository(engine), client, publisher, window=100_000).feed()
        finally:
            engine.dispose()
        return int(client.llen(settings.queue))


def test_stored_input_ids_equal_apply_chat_template(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    rows = sample_rows(300)  # single-turn, system, multi-turn, tools and tool-call history
    assert any("tools" in r for r in rows) and any(len(r["messages"]) > 3 for r in rows)
    summary = enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows))
    assert (summary.accepted, summary.rejected, summary.duplicates) == (300, 0, 0)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    ids = repo.job_ids()
    assert len(ids) == 300
    for job_id in ids:
        job = repo.job(job_id)
        assert job is not None
        expected = reference_ids(tokenizer, rows[job["row_index"]])
        assert job["input_ids"] == expected
        assert job["prompt_tokens"] == len(expected)


def test_every_job_is_published_once_and_re_enqueue_adds_nothing(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", sample_rows(40))
    first = enqueue_file(settings, path)
    assert first.accepted == 40
    assert queue_length(settings) == 40
    again = enqueue_file(settings, path)
    assert (again.accepted, again.duplicates) == (0, 40)
    assert queue_length(settings) == 40
    assert len(repo.job_ids()) == 40


def test_bad_rows_are_recorded_and_the_run_goes_on(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    good = sample_rows(3)
    rows = [
        good[0],
        "{broken json",
        [1, 2],
        {"messages": [{"role": "user", "content": None}]},
        good[1],
        good[1],
        good[2],
        {"prompt": "a NUL \u0000 inside"},  # once refused: the messages were jsonb, which cannot
        {"prompt": "a backslash and u0000: \\u0000"},  # hold one; they are json now
        "binary \x00 garbage",  # its excerpt once failed the insert of the rejections
        # These two failed the whole batch (tokenizer; jsonb), and so the run:
        {"prompt": "a lone surrogate \ud800 here"},
        {"prompt": "hi", "tools": [tool_with_default(float("nan"))]},
        {"prompt": "hello", "tools": [tool_with_default(None)]},  # a null is fine
    ]
    summary = enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows))
    assert summary.accepted == 6
    assert summary.duplicates == 1
    assert summary.rejected == 6
    assert dict(summary.rejected_by_reason) == {
        "invalid_json": 2,
        "not_an_object": 1,
        "empty_prompt": 1,
        "unsupported_content": 2,
    }
    assert repo.rejected_rows() == [
        (1, "invalid_json"),
        (2, "not_an_object"),
        (3, "empty_prompt"),
        (9, "invalid_json"),
        (10, "unsupported_content"),
        (11, "unsupported_content"),
    ]
    stored = {job["row_index"]: job for job in map(repo.job, repo.job_ids()) if job}
    assert stored[12]["messages"]["tools"] == [tool_with_default(None)]
    assert stored[7]["messages"]["messages"] == [{"role": "user", "content": "a NUL \u0000 inside"}]


def tool_with_default(value: Any) -> dict[str, Any]:
    """A tool whose one parameter has ``value`` as its default."""
    parameters = {"type": "object", "properties": {"x": {"type": "number", "default": value}}}
    return {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": parameters},
    }


def test_thinking_kwarg_reaches_the_template(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    rows = sample_rows(5)
    enqueue_file(
        settings, write_jsonl(tmp_path / "d.jsonl", rows), chat_template_kwargs={"thinking": False}
    )
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    for job_id in repo.job_ids():
        job = repo.job(job_id)
        assert job is not None
        assert job["input_ids"] == reference_ids(tokenizer, rows[job["row_index"]], thinking=False)
        assert job["input_ids"][-2:] == [think, end_think]


def test_prompts_too_long_for_the_context_are_rejected(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = sample_rows(300)
    stats = enqueue_file(
        settings, write_jsonl(tmp_path / "d.jsonl", rows), max_new_tokens=20, max_context_len=100
    )
    assert stats.rejected_by_reason["too_long"] > 0
    assert stats.accepted + stats.rejected == 300
    for job_id in repo.job_ids():
        job = repo.job(job_id)
        assert job is not None and job["prompt_tokens"] + 20 <= 100
    reasons = {reason for _, reason in repo.rejected_rows()}
    assert reasons == {"too_long"}


def test_changing_sampling_params_is_refused(settings: Settings, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", sample_rows(3))
    enqueue_file(settings, path, max_new_tokens=256)
    with pytest.raises(ValueError, match="start a new run"):
        enqueue_file(settings, path, max_new_tokens=512)
    assert queue_length(settings) == 3


def test_a_dataset_keeps_its_budget_and_the_enqueue_says_so(
    settings: Settings, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", sample_rows(4))

    def enqueue(budget: int | None, basis: BudgetBasis = BudgetBasis.COMPLETION) -> Any:
        sampling = {"max_new_tokens": 64}
        plan = RunPlan(
            run="r",
            tokenizer=TOKENIZER_DIR,
            datasets=[
                DatasetPlan("d", path, sampling=sampling, budget_tokens=budget, budget_basis=basis)
            ],
        )
        return run_enqueue(settings, settings.services(), plan, quiet=True).as_dict()

    assert enqueue(1_000)["warnings"] == []
    again = enqueue(2_500_000)
    assert again["datasets"]["d"]["budget_tokens"] == 1_000  # the budget in force
    assert again["warnings"] == [
        "dataset 'd' keeps its budget 1.0k (this enqueue asked for 2.5M); "
        "to change it: eaglegen budget set --run r d 2500000"
    ]
    with pytest.raises(ValueError, match="'completion' basis; start a new run"):
        enqueue(1_000, BudgetBasis.TOTAL)
    assert queue_length(settings) == 4


def test_a_hub_snapshot_folder_is_enqueued_like_its_rows(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    # Parquet columns have one type: rows whose contents are all strings, without tools.
    plain = [r for r in sample_rows(300) if "tools" not in r]
    rows = [r for r in plain if all(isinstance(m.get("content"), str) for m in r["messages"])]
    rows = rows[:40]
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for shard, part in enumerate((rows[:25], rows[25:])):
        name = f"train-{shard:05d}-of-00002.parquet"
        pq.write_table(pa.Table.from_pylist(part), tmp_path / "hub" / "data" / name)
    summary = enqueue_file(settings, tmp_path / "hub")
    assert (summary.accepted, summary.rejected) == (40, 0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    for job_id in repo.job_ids():
        job = repo.job(job_id)
        assert job is not None
        assert job["input_ids"] == reference_ids(tokenizer, rows[job["row_index"]])
    assert queue_length(settings) == 40


def test_another_chat_template_is_refused(settings: Settings, tmp_path: Path) -> None:
    import json
    import shutil

    other = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("helpful", "terse")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "d.jsonl", sample_rows(2))
    enqueue_file(settings, path)
    with pytest.raises(ValueError, match="chat template"):
        run_enqueue(
            settings,
            settings.services(),
            RunPlan(
                run="run",
                tokenizer=other,
                datasets=[DatasetPlan("d", path, sampling={"max_new_tokens": 256})],
            ),
            quiet=True,
        )


def test_dry_run_writes_nothing_and_reports_the_numbers(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    rows = [*sample_rows(50), *sample_rows(10), "{bad"]
    plan = RunPlan(
        run="dry",
        tokenizer=TOKENIZER_DIR,
        datasets=[
            DatasetPlan(
                "d",
                write_jsonl(tmp_path / "d.jsonl", rows),
                sampling={"max_new_tokens": 100},
                budget_tokens=1000,
                budget_basis=BudgetBasis.TOTAL,
            )
        ],
    )
    report = run_enqueue(settings, None, plan, quiet=True)
    doc = report.as_dict()["datasets"]["d"]
    assert (doc["rows"], doc["accepted"], doc["duplicates"], doc["rejected"]) == (61, 50, 10, 1)
    assert doc["rejected_by_reason"] == {"invalid_json": 1}
    assert 0 < doc["prompt_tokens"]["p50"] <= doc["prompt_tokens"]["p99"]
    assert doc["prompt_tokens"]["p99"] <= doc["prompt_tokens"]["max"]
    assert doc["worst_case_tokens"] > 50 * 100  # total basis adds the prompt tokens
    assert repo.job_ids() == [] and repo.counts() == []
    assert queue_length(settings) == 0


def test_a_run_file_with_two_datasets(settings: Settings, repo: Repository, tmp_path: Path) -> None:
    rows = sample_rows(40)
    write_jsonl(tmp_path / "a.jsonl", rows[:20])
    write_jsonl(tmp_path / "b.jsonl", rows[20:])
    (tmp_path / "run.toml").write_text(f"""
run = "two"
tokenizer = "{TOKENIZER_DIR}"
[sampling]
max_new_tokens = 64
[[datasets]]
name = "a"
path = "a.jsonl"
budget_tokens = "10M"
[[datasets]]
name = "b"
path = "b.jsonl"
limit = 5
sample_seed = 3
""")
    report = run_enqueue(
        settings,
        settings.services(),
        plan_from_run_file(load_run_file(tmp_path / "run.toml")),
        quiet=True,
    )
    assert report.as_dict()["accepted"] == 25
    counts = {c.dataset: c.total for c in repo.counts("two")}
    assert counts == {"a": 20, "b": 5}
    assert queue_length(settings) == 25
