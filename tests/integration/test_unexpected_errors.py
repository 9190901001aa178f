"""An error no check foresaw ends its attempt at once, the cause kept on the job: never a job
left `running` until its lease lapses with "lease expired" as its only trace."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from core.settings import ServerSpec, Settings
from models.repository import Repository
from models.states import JobState
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.hostile import Answer, Behaviour, good, hostile_server
from tests.integration.test_pipeline import worker
from tests.workers import EACH_ENGINE

pytestmark = EACH_ENGINE


def nul_in_metadata(request: dict[str, Any]) -> Answer:
    """A body every check passes, with a NUL in a meta_info string: Postgres's jsonb cannot
    hold it, so the record itself fails."""
    return good(request, weight_version="v\u0000")


def test_a_body_postgres_cannot_store_fails_the_job_with_its_cause_at_once(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    with hostile_server(Behaviour(nul_in_metadata)) as url:
        hostile = settings.model_copy(
            update={
                "servers": [ServerSpec(name="hostile", url=url)],
                "max_attempts": 2,
                "retry_base_s": 0.1,
                "lease_seconds": 600,  # what the job would have waited, per attempt, before
            }
        )
        started = time.monotonic()
        with worker(hostile):
            enqueue_file(hostile, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
            states = wait_settled(repo, timeout_s=60)
        elapsed = time.monotonic() - started
    assert states[JobState.FAILED.value] == 1
    [job_id] = repo.job_ids()
    job = repo.job(job_id)
    assert job is not None and job["attempts"] == 2
    # The server, the error's class (SQLAlchemy's DataError, or psycopg's own subclass of
    # it on the loop engine's connections), then the database's reason.
    assert re.match(r"hostile: \w+: ", job["last_error"]), job["last_error"]
    assert "\\u0000" in job["last_error"]  # the database's reason
    assert repo.generation(job_id) is None
    assert elapsed < 60
