"""A worker through outages.

Its log through a database outage: one line when it starts, a short reminder per
EAGLEGEN_LOG_REMINDER_S, one line when it ends; no stack trace and no line per pass or job.
An `eaglegen worker` process reaches the test's real Postgres through a gate (tests/sockets.py)
that the test shuts (every connection cut, the port closed) and opens again.

And what an outage or a busy pool must not do (issue 27): turn a recorded job's task into a
FAILURE when its slot cannot be given back, or stop the renewal of job leases."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.signals import task_postrun
from sqlalchemy import select

from core import keys
from core.settings import ServerSpec, Settings
from eaglegen.sim import SimServer
from models.repository import Repository
from models.schema import Job
from models.states import JobState
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.hostile import Answer, Behaviour, good, hostile_server
from tests.integration.test_worker_processes import live_pids, wait_for, worker_env, worker_process
from tests.outage import PATIENCE_S, let_in, shut_out
from tests.outage import wait_for as wait_until
from tests.sockets import database_gate
from tests.workers import EACH_ENGINE, in_thread_worker
from worker.runner import SLOTS_KEPT

pytestmark = EACH_ENGINE

JOBS = 40
REMINDER_S = 2.0
STARTS = "database unreachable: "
REMINDS = "database unreachable (for "
ENDS = re.compile(r"database back after \d+ s")


def test_a_database_outage_is_one_line_reminders_and_one_line_when_it_ends(
    settings: Settings, repo: Repository, sim: SimServer, tmp_path: Path
) -> None:
    # The worker's database goes away while jobs wait in Postgres: its feeder, which must
    # read them to publish them, fails at every pass until the database is back.
    assert settings.database_url is not None
    rows = sample_rows(2 * JOBS)
    log = tmp_path / "worker.log"
    with database_gate(settings.database_url) as gate:
        env = {
            **worker_env(settings, [{"name": "sim", "url": sim.url}]),
            "EAGLEGEN_DATABASE_URL": gate.database_url(settings.database_url),
            "EAGLEGEN_LOG_REMINDER_S": str(REMINDER_S),
        }
        with worker_process(env, log, "--concurrency", "8") as process:
            wait_for(lambda: process.pid in live_pids(settings), what="heartbeat", log=log)
            first = write_jsonl(tmp_path / "first.jsonl", rows[:JOBS])
            enqueue_file(settings, first, max_new_tokens=8)
            wait_for(lambda: _done(repo) == JOBS, 60, "the first jobs done", log)
            gate.shut()
            second = write_jsonl(tmp_path / "second.jsonl", rows[JOBS:])
            enqueue_file(settings, second, max_new_tokens=8)  # the test's own connection
            wait_for(lambda: STARTS in log.read_text(), 30, "the outage said", log)
            # Three reminders: the worker went on trying for three reminder intervals.
            wait_for(lambda: log.read_text().count(REMINDS) >= 3, 60, "three reminders", log)
            gate.open()
            wait_for(lambda: ENDS.search(log.read_text()), 60, "the end said", log)
            states = wait_settled(repo, timeout_s=120)
    assert states.get("done") == 2 * JOBS, states
    text = log.read_text()
    start, end = text.index(STARTS), ENDS.search(text)
    assert end is not None
    during = text[text.rindex("\n", 0, start) + 1 : end.end()].splitlines()
    reminders = [line for line in during if REMINDS in line]
    print(f"{len(during)} line(s) from the outage's start to its end:", *during, sep="\n")
    assert "Traceback" not in text, text[-5000:]
    assert text.count(STARTS) == 1 and len(ENDS.findall(text)) == 1, during
    # The outage's first line, its reminders, its end, and at most a few other changes of
    # state (a server or loop is not expected to change then): not a line per pass or job.
    assert len(during) <= 2 + len(reminders) + 3, during
    assert all(line.rstrip().endswith("; retrying") for line in reminders), reminders
    # A reminder per EAGLEGEN_LOG_REMINDER_S at most, by the log's own clock.
    lasted = _stamp(during[-1]) - _stamp(during[0])
    assert len(reminders) <= lasted / REMINDER_S + 1, (lasted, reminders)


def _stamp(line: str) -> float:
    """Seconds since midnight of a Celery log line (``[2026-12-03 12:32:18,998: ...``)."""
    match = re.match(r"\[\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3})", line)
    assert match, line
    hours, minutes, seconds, millis = map(int, match.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def _done(repo: Repository) -> int:
    return sum(c.states.get("done", 0) for c in repo.counts())


@contextmanager
def held_server(settings: Settings) -> Iterator[tuple[Settings, Behaviour, threading.Event]]:
    """A server that answers /generate well, once the test sets the event: the settings
    that call it, what it saw, the event (set at the end however the test ends)."""
    go = threading.Event()

    def answer(request: dict[str, Any]) -> Answer:
        go.wait(PATIENCE_S)
        return good(request)

    behaviour = Behaviour(answer)
    try:
        with hostile_server(behaviour) as url:
            server = [ServerSpec(name="held", url=url)]
            yield settings.model_copy(update={"servers": server}), behaviour, go
    finally:
        go.set()


def sent(behaviour: Behaviour) -> Callable[[], bool]:
    """Whether the one request was sent (its job claimed, its slot held)."""
    return lambda: behaviour.requests == 1


@contextmanager
def task_states() -> Iterator[list[str]]:
    """The states the generate tasks of this process end in (Celery's task_postrun): what
    Flower and the task metrics show."""
    states: list[str] = []

    def ended(state: str | None = None, **_: Any) -> None:
        states.append(str(state))

    task_postrun.connect(ended, weak=False)
    try:
        yield states
    finally:
        task_postrun.disconnect(ended)


def test_a_slot_redis_refuses_to_take_back_leaves_a_recorded_job_a_success(
    settings: Settings, repo: Repository, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis fails exactly at the release that follows the record: the slots' key becomes a
    # string, on which the release's ZREM fails (WRONGTYPE). A whole-Redis outage would cut
    # Celery's broker too, which is not what this pins down.
    caplog.set_level(logging.WARNING, logger="worker")  # the in-thread Celery sets root to ERROR
    client = redis.Redis.from_url(settings.services().broker_url)
    try:
        with (
            held_server(settings) as (held, behaviour, go),
            task_states() as states,
            in_thread_worker(held) as (ctx, _),
        ):
            enqueue_file(held, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
            wait_until(sent(behaviour), "the request sent")
            client.set(keys.slots("held"), "not a sorted set")
            go.set()

            def done() -> float | None:
                return ctx.metrics.registry.get_sample_value(
                    "eaglegen_worker_job_attempts_total", {"outcome": "done"}
                )

            wait_until(lambda: done() is not None, "the attempt's end")
            wait_until(lambda: any(SLOTS_KEPT in r.getMessage() for r in caplog.records), "it")
            kept = [s.held for s in ctx.router.servers]
            ended = done()
    finally:
        client.delete(keys.slots("held"))
        client.close()
    if settings.worker_engine == "celery":  # the loop engine has no Celery task
        wait_until(lambda: bool(states), "the task's end")
        assert states[0] == "SUCCESS", states
    assert ended == 1
    assert wait_settled(repo, timeout_s=10)[JobState.DONE.value] == 1
    assert repo.generation_count() == 1
    assert kept == [set()]  # no longer renewed: the slot's lease lapses by itself
    said = [r.getMessage() for r in caplog.records if SLOTS_KEPT in r.getMessage()]
    assert len(said) == 1 and "WRONGTYPE" in said[0], said


def lease_until(repo: Repository, job_id: int) -> datetime:
    """The job's lease, as Postgres holds it."""
    with repo.engine.connect() as conn:
        lease = conn.scalar(select(Job.lease_until).where(Job.id == job_id))
    assert lease is not None
    return lease


def test_job_leases_are_renewed_with_every_pooled_connection_taken_and_after_an_outage(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # One pooled connection, held here as by a task thread blocked inside a transaction;
    # leases of 3 s, renewed every second.
    assert settings.database_url is not None
    small = settings.model_copy(update={"db_pool_size": 1, "lease_seconds": 3})
    with held_server(small) as (held, behaviour, go), in_thread_worker(held) as (ctx, _):
        enqueue_file(held, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)))
        wait_until(sent(behaviour), "the request sent")
        [job_id] = repo.job_ids()
        with ctx.repo.engine.connect():
            before = lease_until(repo, job_id)
            wait_until(lambda: lease_until(repo, job_id) > before, "a renewal, the pool taken")
        shut_out(settings.database_url)  # every session ended, the leases' own one too
        let_in(settings.database_url)
        after = lease_until(repo, job_id)
        wait_until(lambda: lease_until(repo, job_id) > after, "a renewal after the outage")
        go.set()
        states = wait_settled(repo, timeout_s=60)
    assert states[JobState.DONE.value] == 1
    job = repo.job(job_id)
    assert job is not None and job["attempts"] == 1  # its lease never lapsed
