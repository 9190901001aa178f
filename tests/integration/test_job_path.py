"""bench.job_path, the job's own path with no Celery around it (issue 32's upper bound), runs
every job of a run to `done` through the runner, in either order of slot and claim, against
real Postgres, Redis and the simulator: its figures count only finished work."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from bench.common import write_short_prompts
from bench.job_path import QUEUE, main, queued_jobs, run_jobs
from core.settings import ServerSpec, Settings
from eaglegen.stack import free_port
from models.repository import Repository
from tests.helpers import enqueue_file
from worker.runner import WorkerContext

JOBS = 40
OF_RUN = """
SELECT jobs.state, jobs.attempts FROM jobs JOIN datasets ON datasets.id = jobs.dataset_id
JOIN runs ON runs.id = datasets.run_id WHERE runs.name = :run
"""


@pytest.mark.parametrize("ahead", [False, True], ids=["slot-first", "claim-ahead"])
def test_every_job_ends_done_once(
    settings: Settings, repo: Repository, tmp_path: Path, ahead: bool
) -> None:
    enqueue_file(settings, write_short_prompts(tmp_path / "p.jsonl", JOBS), max_new_tokens=8)
    limit = 4
    local = settings.model_copy(
        update={"queue": QUEUE, "server_max_inflight": limit, "adaptive_concurrency": False}
    )
    ctx = WorkerContext.build(local, local.services(), list(settings.servers))
    try:
        jobs = queued_jobs(ctx.repo.engine, "run")
        assert len(jobs) == JOBS
        ended = run_jobs(ctx, jobs, 2 * limit if ahead else limit, ahead)
    finally:
        ctx.close()
    assert ended == {"done": JOBS}
    with repo.engine.connect() as conn:
        states = dict(conn.execute(text("SELECT state, count(*) FROM jobs GROUP BY state")).all())
        attempts = conn.execute(text("SELECT max(attempts) FROM jobs")).scalar_one()
        generations = conn.execute(text("SELECT count(*) FROM generations")).scalar_one()
    assert states == {"done": JOBS}
    assert attempts == 1  # no job claimed twice, whichever came first
    assert generations == JOBS


def test_the_command_says_what_ended_and_fails_unless_all_done(
    settings: Settings, repo: Repository, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue_file(settings, write_short_prompts(tmp_path / "p.jsonl", 10), max_new_tokens=8)
    [server] = settings.servers
    assert isinstance(server, ServerSpec)
    assert settings.database_url is not None and settings.broker_url is not None
    common = ["--database-url", settings.database_url, "--broker-url", settings.broker_url]
    common += ["--server", server.url, "--concurrency", "3"]
    assert main([*common, "--run", "run"]) == 0
    assert "10 jobs: {'done': 10}" in capsys.readouterr().out
    # Nothing queued is left: an empty run is all done.
    assert main([*common, "--run", "run"]) == 0
    assert "0 jobs: {}" in capsys.readouterr().out
    # No server answers: the jobs cannot start, and the command says so and fails.
    enqueue_file(settings, write_short_prompts(tmp_path / "q.jsonl", 3), run="other")
    down = ["--server", f"http://127.0.0.1:{free_port()}"]
    assert main([*common, *down, "--run", "other"]) == 1
    assert "3 jobs: {'no_slot': 3}" in capsys.readouterr().out
    # Claimed first, then no slot: each job goes back queued, no attempt spent.
    assert main([*common, *down, "--run", "other", "--claim-ahead"]) == 1
    assert "3 jobs: {'no_slot': 3}" in capsys.readouterr().out
    with repo.engine.connect() as conn:
        left = conn.execute(text(OF_RUN), {"run": "other"}).all()
    assert sorted(left) == [("queued", 0)] * 3
