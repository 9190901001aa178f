"""A real worker, each engine (Celery's threads pool, and the event loop of worker.loop),
against the simulator and real Postgres and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from models.repository import Repository
from models.states import JobState
from tests.helpers import enqueue_file, family_tokenizer, sample_rows, wait_settled, write_jsonl
from tests.workers import EACH_ENGINE, in_thread_worker

pytestmark = EACH_ENGINE


@contextmanager
def worker(settings: Settings) -> Iterator[None]:
    """A real worker in this process, on the settings' servers."""
    with in_thread_worker(settings.model_copy(update={"worker_concurrency": 16})):
        yield


@pytest.fixture
def running_worker(settings: Settings) -> Iterator[None]:
    with worker(settings):
        yield


@pytest.mark.embedded
def test_every_job_is_done_once_with_the_servers_exact_output(
    settings: Settings, repo: Repository, sim: SimServer, running_worker: None, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(80)), max_new_tokens=300)
    states = wait_settled(repo)
    assert states["done"] == 80 and sum(states.values()) == 80
    assert repo.generation_count() == 80
    jobs = [repo.job(job_id) for job_id in repo.job_ids()]
    assert all(job is not None for job in jobs)
    params = repo.sampling_params(jobs[0]["dataset_id"])  # type: ignore[index]
    # One batch request asks the simulator again for every prompt: its output is
    # deterministic, so the stored ids must equal what it sends now.
    direct = httpx.post(
        f"{sim.url}/generate",
        timeout=120,
        json={
            "input_ids": [job["input_ids"] for job in jobs],  # type: ignore[index]
            "sampling_params": params,
        },
    ).json()
    for job, expected in zip(jobs, direct, strict=True):
        assert job is not None
        gen = repo.generation(job["id"])
        assert gen is not None
        assert gen["output_ids"] == expected["output_ids"]
        assert gen["completion_tokens"] == len(gen["output_ids"])
        assert gen["prompt_tokens"] == len(job["input_ids"])
        assert gen["server"] == "sim"
        assert job["attempts"] == 1
        # The template opens <think>: every generation says whether it closed it.
        assert gen["reasoning_tokens"] + gen["answer_tokens"] == gen["completion_tokens"]
        if gen["finish_type"] == "stop":
            assert gen["think_end_present"] is True


def test_without_a_think_block_no_reasoning_split_is_recorded(
    settings: Settings, repo: Repository, running_worker: None, tmp_path: Path
) -> None:
    enqueue_file(
        settings,
        write_jsonl(tmp_path / "d.jsonl", sample_rows(3)),
        chat_template_kwargs={"thinking": False},
    )
    assert wait_settled(repo)["done"] == 3
    for job_id in repo.job_ids():
        gen = repo.generation(job_id)
        assert gen is not None and gen["think_end_present"] is None


def test_a_prompt_too_long_for_the_context_fails_with_the_servers_message(
    settings: Settings, repo: Repository, running_worker: None, tmp_path: Path
) -> None:
    enqueue_file(
        settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(2)), max_new_tokens=10_000_000
    )
    states = wait_settled(repo)
    assert states["failed"] == 2
    for job_id in repo.job_ids(state=JobState.FAILED):
        job = repo.job(job_id)
        assert job is not None
        assert "HTTP 400" in job["last_error"] and "context length" in job["last_error"]
        assert job["attempts"] == 1
    assert repo.generation_count() == 0


ASKS = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(6)]
AFTER_TOOL = [
    {
        "messages": [
            {"role": "user", "content": f"Weather in city {i}?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "sunny"},
        ]
    }
    for i in range(4)
]


@pytest.mark.parametrize(
    ("family", "opening_rows"),
    [("qwen3_thinking", set(range(10))), ("deepseek_r1", set(range(6)))],
)
def test_a_reasoning_block_is_expected_only_of_jobs_whose_prompt_opens_one(
    settings: Settings, repo: Repository, tmp_path: Path, family: str, opening_rows: set[int]
) -> None:
    # `<think>\n` ends these families' generation prompts; R1's adds none after a tool turn.
    tokenizer = family_tokenizer(tmp_path, family)
    config = SimConfig(seed=7, decode_step_ms=0.5, decode_ms_per_request=0.02)
    with SimServer(replace(config, tokenizer_dir=tokenizer)) as sim:
        served = settings.model_copy(update={"servers": [ServerSpec(name="sim", url=sim.url)]})
        with worker(served):
            path = write_jsonl(tmp_path / "d.jsonl", ASKS + AFTER_TOOL)
            enqueue_file(served, path, tokenizer=tokenizer, max_new_tokens=400)
            assert wait_settled(repo)["done"] == 10
    for job_id in repo.job_ids():
        job, gen = repo.job(job_id), repo.generation(job_id)
        assert job is not None and gen is not None
        opens = job["row_index"] in opening_rows
        assert job["opens_reasoning"] is opens
        if opens:
            assert gen["reasoning_tokens"] + gen["answer_tokens"] == gen["completion_tokens"]
            assert isinstance(gen["think_end_present"], bool)
            if gen["finish_type"] == "stop":  # the simulator closes every block it finishes
                assert gen["think_end_present"]
        else:
            assert gen["think_end_present"] is None and gen["reasoning_tokens"] is None
