"""Workers asking for streamed answers (EAGLEGEN_STREAM): the same exact output as a whole
answer, in either of SGLang's id modes, and a stream that stops making progress fails its
attempt after the stall timeout, not the hour-long request timeout."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from core.settings import ServerSpec, Settings
from eaglegen.sim import SimConfig, SimServer
from eaglegen.sim.config import FaultConfig
from models.repository import Repository
from models.schema import Dataset
from models.states import JobState
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker
from tests.workers import EACH_ENGINE

pytestmark = EACH_ENGINE

FAST = SimConfig(seed=7, decode_step_ms=0.5, decode_ms_per_request=0.02, stream_interval=4)


def streaming(settings: Settings, sim: SimServer, **knobs: object) -> Settings:
    return settings.model_copy(
        update={"servers": [ServerSpec(name="sim", url=sim.url)], "stream": True, **knobs}
    )


@pytest.mark.parametrize("incremental", [False, True])
def test_a_streamed_generation_is_stored_exactly_as_a_whole_answer(
    settings: Settings, repo: Repository, tmp_path: Path, incremental: bool
) -> None:
    with SimServer(replace(FAST, incremental_streaming_output=incremental)) as sim:
        streamed = streaming(settings, sim)
        with worker(streamed):
            enqueue_file(streamed, write_jsonl(tmp_path / "d.jsonl", sample_rows(12)))
            states = wait_settled(repo, timeout_s=60)
        assert states[JobState.DONE.value] == 12
        with repo.engine.connect() as conn:
            params = conn.scalar(select(Dataset.sampling_params))
        with httpx.Client(base_url=sim.url, timeout=30) as client:
            for job_id in repo.job_ids():
                job, generation = repo.job(job_id), repo.generation(job_id)
                assert job is not None and generation is not None
                whole = client.post(
                    "/generate",
                    json={
                        "input_ids": job["input_ids"],
                        "sampling_params": params,
                        "rid": str(job_id),
                    },
                ).json()
                assert generation["output_ids"] == whole["output_ids"]
                assert generation["completion_tokens"] == len(whole["output_ids"])


def test_a_stream_that_stalls_fails_its_attempt_after_the_stall_timeout(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    stalling = replace(FAST, faults=FaultConfig(stall_rate=1.0, stall_after_chunks=1))
    with SimServer(stalling) as sim:
        streamed = streaming(
            settings,
            sim,
            stall_timeout_s=2.0,
            request_timeout_s=600.0,
            max_attempts=2,
            retry_base_s=0.1,
        )
        started = time.monotonic()
        with worker(streamed):
            enqueue_file(
                streamed, write_jsonl(tmp_path / "d.jsonl", sample_rows(2)), max_new_tokens=512
            )
            states = wait_settled(repo, timeout_s=60)
        elapsed = time.monotonic() - started
    assert states[JobState.FAILED.value] == 2
    for job_id in repo.job_ids():
        job = repo.job(job_id)
        assert job is not None and job["attempts"] == 2
        assert "timed out" in job["last_error"] or "no streamed chunk" in job["last_error"]
        assert repo.generation(job_id) is None
    assert elapsed < 30  # two attempts of ~2 s each, not 600 s


@pytest.mark.parametrize("incremental", [True, False])
def test_by_default_workers_stream_from_a_server_that_streams_incrementally(
    settings: Settings, repo: Repository, tmp_path: Path, incremental: bool
) -> None:
    # Every streamed request stalls after its first chunk: only a worker that streams sees
    # it (and fails the attempts after the stall timeout); one taking whole answers does not.
    stalling = replace(
        FAST,
        incremental_streaming_output=incremental,
        faults=FaultConfig(stall_rate=1.0, stall_after_chunks=1),
    )
    with SimServer(stalling) as sim:
        auto = settings.model_copy(
            update={
                "servers": [ServerSpec(name="sim", url=sim.url)],
                "stall_timeout_s": 2.0,
                "max_attempts": 1,
            }
        )
        assert auto.stream is None
        with worker(auto):
            enqueue_file(auto, write_jsonl(tmp_path / "d.jsonl", sample_rows(3)))
            states = wait_settled(repo, timeout_s=60)
    expected = JobState.FAILED if incremental else JobState.DONE
    assert states[expected.value] == 3, states
