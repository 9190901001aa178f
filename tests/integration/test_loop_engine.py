"""What only the loop engine (worker.loop) does itself, against real Postgres, Redis and the
simulator: it holds a message with an ETA until then (Celery holds it for the other
engine), and a stop publishes again the messages it took and never claimed.

The rest of its behaviour runs through the tests both engines share (``EACH_ENGINE``: the
pipeline, the fault knobs, the hostile servers, the outages, the conversations, the worker
processes)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import redis
from sqlalchemy import text

from core import wire
from core.broker import Publisher
from core.settings import Settings
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.outage import wait_for
from tests.workers import in_thread_worker
from worker.feeder import Feeder


def published_alone(settings: Settings, repo: Repository, tmp_path: Path) -> int:
    """One job enqueued and published by a feeder pass, its message taken off the queue
    again (as a worker takes it): the job id, its message counted as out."""
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(1)), max_new_tokens=8)
    url = settings.services().broker_url
    with redis.Redis.from_url(url) as client, Publisher(url, settings.queue) as publisher:
        assert Feeder(repo, client, publisher, window=8).feed().published == 1
        job = wire.job_id_of(client.rpop(settings.queue))
    assert job is not None
    return job


def messages(settings: Settings) -> list[wire.Message]:
    """The messages waiting in the queue list."""
    with redis.Redis.from_url(settings.services().broker_url) as client:
        raw = client.lrange(settings.queue, 0, -1)
    return [m for each in raw if (m := wire.read(each)) is not None]


def test_a_message_with_an_eta_is_run_once_due_and_not_before(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    loop = settings.model_copy(update={"worker_engine": "loop"})
    job = published_alone(loop, repo, tmp_path)
    with Publisher(loop.services().broker_url, loop.queue) as publisher:
        publisher.publish_later(job, countdown=2.0, retries=1)
    [message] = messages(loop)
    assert message.job_id == job and message.eta is not None and message.retries == 1
    with in_thread_worker(loop):
        wait_for(lambda: not messages(loop), "the message taken")
        states = wait_settled(repo, timeout_s=60)
    assert states["done"] == 1
    with repo.engine.connect() as conn:
        recorded = conn.scalar(
            text("SELECT created_at FROM generations WHERE job_id = :j"), {"j": job}
        )
    assert recorded is not None
    assert recorded >= datetime.fromtimestamp(message.eta, UTC), (recorded, message.eta)


def test_a_stop_publishes_again_the_messages_it_held(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    loop = settings.model_copy(update={"worker_engine": "loop"})
    job = published_alone(loop, repo, tmp_path)
    with Publisher(loop.services().broker_url, loop.queue) as publisher:
        publisher.publish_later(job, countdown=600.0, retries=2, job_tag=wire.tag("d", "run"))
    [sent] = messages(loop)
    with in_thread_worker(loop):
        wait_for(lambda: not messages(loop), "the message taken and held")
    [back] = messages(loop)  # published again at the stop, still held back
    assert back.job_id == job and back.retries == 2 and back.argsrepr == sent.argsrepr
    # Its eta kept: what was left of its wait, from the moment it was published again
    # (never earlier; isoformat keeps microseconds).
    assert sent.eta is not None and back.eta is not None
    assert back.eta >= sent.eta - 1e-3
    [counts] = repo.counts()
    assert counts.states["queued"] == 1  # never claimed
