"""Another model started behind a server's URL: the worker finds it (when the server comes back
from down, and periodically), no job of the old model's runs is recorded from it, and the new
model's runs are served without a restart (issue 27)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis
from sqlalchemy import text

from core import heartbeat
from core.heartbeat import ServerBeat
from core.settings import ServerSpec, Settings
from eaglegen.sim import FaultConfig, SimConfig, SimServer
from models.repository import Repository
from tests.e2e.test_cli import eaglegen, service_env
from tests.helpers import enqueue_file, sample_rows, write_jsonl
from tests.integration.test_model_routing import by_run
from tests.workers import in_thread_worker
from worker.runner import WorkerContext

FAST = SimConfig(seed=3, decode_step_ms=0.5, decode_ms_per_request=0.02)
A, B = "org/model-a", "org/model-b"
NAME = "swapped"  # the one server's name: one URL, two models one after the other
NEVER = 3600.0  # an interval that does not come round within a test
CHANGE = f"server {NAME} now serves model {B}"  # the warning the change is said with
T = TypeVar("T")


class OnePort:
    """A simulator on one port, replaced by another of another model on the same port."""

    def __init__(self, model: str) -> None:
        self.current = SimServer(replace(FAST, model_path=model))

    def __enter__(self) -> OnePort:
        self.current.__enter__()
        return self

    @property
    def url(self) -> str:
        return self.current.url

    def stop(self) -> None:
        self.current.__exit__(None, None, None)

    def start(self, model: str, latency_ms: float = 0.0) -> None:
        """Start a simulator of ``model`` where the stopped one was."""
        port = int(self.url.rsplit(":", 1)[1])
        faults = FaultConfig(added_latency_ms=latency_ms)
        self.current = SimServer(replace(FAST, model_path=model, port=port, faults=faults))
        self.current.__enter__()

    def __exit__(self, *_: object) -> None:
        self.stop()


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """``probe()`` once it is truthy; a bound on failure only, never a measured window."""
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)
    return found


@contextmanager
def worker_on(
    settings: Settings, server: OnePort, *, health_s: float, reidentify_s: float
) -> Iterator[WorkerContext]:
    """A real worker (Celery threads pool and side loops) on the one server."""
    update = {
        "servers": [ServerSpec(name=NAME, url=server.url)],
        "health_interval_s": health_s,
        "reidentify_interval_s": reidentify_s,
        "heartbeat_interval_s": 0.2,
    }
    with in_thread_worker(settings.model_copy(update=update)) as (ctx, _):
        yield ctx


def beat_of(settings: Settings, worker: WorkerContext) -> ServerBeat | None:
    """The server as the worker's last heartbeat shows it (another test session may share
    the Redis database: its workers' heartbeats are not this one's)."""
    assert settings.broker_url is not None
    with redis.Redis.from_url(settings.broker_url) as client:
        beats = [b for b in heartbeat.read_all(client) if b.worker == worker.name]
    return beats[0].servers[NAME] if beats else None


def seen_down(settings: Settings, worker: WorkerContext) -> bool:
    beat = beat_of(settings, worker)
    return beat is not None and not beat.healthy


def changed(settings: Settings, worker: WorkerContext) -> ServerBeat | None:
    """The heartbeat once it says the server serves B, seen serving A before."""
    beat = beat_of(settings, worker)
    return beat if beat and (beat.model, beat.previous_model) == (B, A) else None


def enqueue(settings: Settings, tmp_path: Path, run: str, model: str, dataset: str) -> None:
    rows = sample_rows(8)
    path = write_jsonl(tmp_path / f"{run}-{dataset}.jsonl", rows)
    enqueue_file(settings, path, run=run, model=model, dataset=dataset, max_new_tokens=32)


def done_of(repo: Repository, run: str) -> int:
    return by_run(repo).get(run, {}).get("done", 0)


def waiting_of_d2(repo: Repository) -> list[tuple[str, str | None]]:
    """State and last error of run ra's jobs enqueued after the swap (dataset d2)."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT jobs.state, jobs.last_error FROM jobs"
                " JOIN datasets ON datasets.id = jobs.dataset_id"
                " JOIN runs ON runs.id = datasets.run_id"
                " WHERE runs.name = 'ra' AND datasets.name = 'd2'"
            )
        ).all()
    return [(str(state), error) for state, error in rows]


def settled_d2(repo: Repository) -> list[tuple[str, str | None]] | None:
    """Run ra's later jobs once each was recorded done or given back for wanting model A
    (a job may first retry a connection the stopped server closed)."""
    jobs = waiting_of_d2(repo)
    settled = jobs and all(
        state == "done" or f"wants model '{A}'" in (error or "") for state, error in jobs
    )
    return jobs if settled else None


def changes_said(caplog: pytest.LogCaptureFixture) -> int:
    return sum(CHANGE in record.getMessage() for record in caplog.records)


def after_swap_a_waits_and_b_is_served(
    settings: Settings, repo: Repository, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the worker saw the change: run rb (of B) is served without a restart, and run
    ra's new jobs are given back (refunded, queued), never recorded from B."""
    enqueue(settings, tmp_path, "rb", B, "d")
    enqueue(settings, tmp_path, "ra", A, "d2")
    # A job may first retry a connection the stopped server closed, after a backoff that
    # grows with each attempt: more than the default bound on a loaded machine (CI).
    jobs = wait_for("every later job of run ra settled", lambda: settled_d2(repo), 120)
    assert "done" not in {state for state, _ in jobs}, jobs
    assert done_of(repo, "ra") == 8  # the jobs of d, generated by A before the swap
    wait_for("run rb served by the new model", lambda: done_of(repo, "rb") == 8)
    assert changes_said(caplog) == 1


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="worker.servers")
    return caplog


def test_a_server_back_from_down_says_again_what_it_serves(
    settings: Settings, repo: Repository, tmp_path: Path, said: pytest.LogCaptureFixture
) -> None:
    # Only the way back from down can find the change: the periodic check never comes round.
    with (
        OnePort(A) as server,
        worker_on(settings, server, health_s=0.2, reidentify_s=NEVER) as ctx,
    ):
        enqueue(settings, tmp_path, "ra", A, "d")
        wait_for("run ra done by model A", lambda: done_of(repo, "ra") == 8)
        server.stop()
        wait_for("the server seen down", lambda: seen_down(settings, ctx))
        server.start(B)
        beat = wait_for("the change in the heartbeat", lambda: changed(settings, ctx))
        assert beat.healthy and beat.model_changed_at is not None
        after_swap_a_waits_and_b_is_served(settings, repo, tmp_path, said)


def test_a_swap_no_health_probe_saw_is_found_by_the_periodic_check(
    settings: Settings, repo: Repository, tmp_path: Path, said: pytest.LogCaptureFixture
) -> None:
    # No health probe runs after the start: the worker never sees the server down.
    with (
        OnePort(A) as server,
        worker_on(settings, server, health_s=NEVER, reidentify_s=0.2) as ctx,
    ):
        enqueue(settings, tmp_path, "ra", A, "d")
        wait_for("run ra done by model A", lambda: done_of(repo, "ra") == 8)
        server.stop()
        server.start(B)
        wait_for("the change in the heartbeat", lambda: changed(settings, ctx))
        after_swap_a_waits_and_b_is_served(settings, repo, tmp_path, said)
        # What an operator sees: the servers table, and a warning line.
        shown = eaglegen("status", env={**service_env(settings), "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    assert f"{B} (changed from {A})" in shown.stdout
    assert f"server {NAME} serves {B} (changed from {A}" in " ".join(shown.stderr.split())


def test_answers_in_flight_when_the_change_is_seen_are_not_recorded(
    settings: Settings, repo: Repository, tmp_path: Path, said: pytest.LogCaptureFixture
) -> None:
    # Neither check comes round by itself: the test asks at the moment it chooses, as the
    # periodic check would, while requests of run ra sent to B (taken for A) are answered.
    with (
        OnePort(A) as server,
        worker_on(settings, server, health_s=NEVER, reidentify_s=NEVER) as ctx,
    ):
        server.stop()
        server.start(B, latency_ms=2500)
        enqueue(settings, tmp_path, "ra", A, "d2")
        wait_for("requests of run ra at model B", lambda: generate_requests(server.url) > 0)
        ctx.router.reidentify(5.0)
        jobs = wait_for("every job of run ra settled", lambda: settled_d2(repo))
    assert "done" not in {state for state, _ in jobs}, jobs
    assert changes_said(said) == 1
    assert any("changed model" in (error or "") for _, error in jobs), jobs
    with repo.engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM generations")) == 0


def generate_requests(url: str) -> int:
    """How many /generate calls the simulator at ``url`` has received."""
    return int(httpx.get(f"{url}/sim/stats", timeout=5).json()["generate_requests"])
