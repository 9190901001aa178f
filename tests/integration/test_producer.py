"""Enqueue against real Postgres and Redis: exact ids, idempotence, rejected rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from eaglegen.assets import TOKENIZER_DIR
from eaglegen.settings import Settings
from models.db import make_engine
from models.repository import Repository
from producer.rows import to_prompt
from tests.helpers import enqueue_file, sample_rows, write_jsonl


@pytest.fixture
def repo(settings: Settings) -> Iterator[Repository]:
    assert settings.database_url is not None
    engine = make_engine(settings.database_url)
    yield Repository(engine)
    engine.dispose()


def queue_length(settings: Settings) -> int:
    assert settings.broker_url is not None
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.llen(settings.queue))
    finally:
        client.close()


def test_stored_input_ids_equal_apply_chat_template(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    rows = sample_rows(60)
    summary = enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows))
    assert (summary.accepted, summary.rejected, summary.duplicates) == (60, 0, 0)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    ids = repo.job_ids()
    assert len(ids) == 60
    for job_id in ids:
        job = repo.job(job_id)
        assert job is not None
        prompt = to_prompt(rows[job["row_index"]])
        expected = tokenizer.apply_chat_template(
            prompt.messages,
            tools=prompt.tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert job["input_ids"] == list(expected)
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
    ]
    summary = enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows))
    assert summary.accepted == 3
    assert summary.duplicates == 1
    assert summary.rejected == 3
    assert dict(summary.rejected_by_reason) == {
        "invalid_json": 1,
        "not_an_object": 1,
        "empty_prompt": 1,
    }
    assert repo.rejected_rows() == [(1, "invalid_json"), (2, "not_an_object"), (3, "empty_prompt")]
