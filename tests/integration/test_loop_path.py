"""bench.loop_path, the job's path from one event loop with batched claims and records (the
measure of docs/design.md §7's batched worker), against real Postgres and the simulator: it
stores exactly what the worker's own path stores for the same prompts, each job once, and a
failed attempt gives its job back. With a broker, its jobs come from the queue's messages,
published by a feeder of its own, as a worker's do."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from bench.common import write_short_prompts
from bench.job_path import QUEUE, queued_jobs, run_jobs
from bench.loop_path import main
from core.settings import ServerSpec, Settings
from eaglegen.stack import free_port
from models.repository import Repository
from tests.helpers import enqueue_file
from worker.runner import WorkerContext

JOBS = 60
OUTPUTS = """
SELECT jobs.input_ids, generations.output_ids, jobs.attempts, jobs.state
FROM jobs JOIN datasets ON datasets.id = jobs.dataset_id JOIN runs ON runs.id = datasets.run_id
LEFT JOIN generations ON generations.job_id = jobs.id WHERE runs.name = :run
"""

PUBLISHED = """
SELECT runs.name, count(jobs.published_at) FROM jobs
JOIN datasets ON datasets.id = jobs.dataset_id JOIN runs ON runs.id = datasets.run_id
GROUP BY runs.name
"""


def outputs(repo: Repository, run: str) -> list[tuple[bytes, bytes | None, int, str]]:
    with repo.engine.connect() as conn:
        rows = conn.execute(text(OUTPUTS), {"run": run}).all()
    return sorted((bytes(i), None if o is None else bytes(o), a, s) for i, o, a, s in rows)


@pytest.mark.parametrize("source", ["list", "queue"])
def test_it_stores_what_the_worker_path_stores(
    settings: Settings,
    repo: Repository,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    source: str,
) -> None:
    prompts = write_short_prompts(tmp_path / "p.jsonl", JOBS)
    for run in ("threads", "loop"):
        enqueue_file(settings, prompts, run=run, max_new_tokens=24)
    local = settings.model_copy(
        update={"queue": QUEUE, "server_max_inflight": 4, "adaptive_concurrency": False}
    )
    ctx = WorkerContext.build(local, local.services(), list(settings.servers))
    try:
        assert run_jobs(ctx, queued_jobs(repo.engine, "threads"), 4) == {"done": JOBS}
    finally:
        ctx.close()
    [server] = settings.servers
    assert isinstance(server, ServerSpec) and settings.database_url is not None
    # Batches smaller than the lanes and the jobs claimed ahead: several of each a round.
    args = ["--database-url", settings.database_url, "--server", server.url, "--run", "loop"]
    if source == "queue":  # the feeder publishes every queued job: the other run's are done
        assert settings.broker_url is not None
        args += ["--broker-url", settings.broker_url, "--queue", settings.queue]
    assert main([*args, "--concurrency", "8", "--batch", "5"]) == 0
    # Its feeder's pass ended before the engine went (else it returns a connection to a
    # disposed pool, which leaves it open to the garbage collector).
    assert not [t for t in threading.enumerate() if t.name == "feeder"]
    assert f"{JOBS} jobs: {{'done': {JOBS}}}" in capsys.readouterr().out
    threads, loop = outputs(repo, "threads"), outputs(repo, "loop")
    assert len(loop) == JOBS and all(o is not None for _, o, _, _ in loop)
    assert loop == threads  # the same prompts, outputs, one attempt each, done
    assert {(a, s) for _, _, a, s in loop} == {(1, "done")}
    assert repo.audit(lease_grace_s=60) == []
    with repo.engine.connect() as conn:
        published = {run: count for run, count in conn.execute(text(PUBLISHED))}
    if source == "queue":  # the loop's jobs came by message, every message was taken
        assert published == {"loop": JOBS, "threads": 0}
        assert redis.Redis.from_url(str(settings.broker_url)).llen(settings.queue) == 0
    else:
        assert published == {"loop": 0, "threads": 0}


def test_a_failed_attempt_gives_its_job_back(
    settings: Settings, repo: Repository, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue_file(settings, write_short_prompts(tmp_path / "p.jsonl", 5), max_new_tokens=8)
    assert settings.database_url is not None
    down = ["--server", f"http://127.0.0.1:{free_port()}", "--concurrency", "2"]
    assert main(["--database-url", settings.database_url, *down, "--run", "run"]) == 1
    assert "5 jobs: {'failed: connection': 5}" in capsys.readouterr().out  # its ErrorKind
    with repo.engine.connect() as conn:
        left = conn.execute(text("SELECT state, attempts, last_error FROM jobs")).all()
    assert {(state, attempts) for state, attempts, _ in left} == {("queued", 0)}
    assert all("ConnectionRefusedError" in error for _, _, error in left), left
    assert repo.audit(lease_grace_s=60) == []
