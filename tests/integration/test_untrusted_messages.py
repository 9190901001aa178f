"""A message that is not JSON is refused unread: a pickle LPUSHed into the queue by hand
(anyone who reaches Redis can) is logged and dropped, never unpickled, and the worker goes
on with the jobs after it."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import uuid
from pathlib import Path

import pytest
import redis

from core.settings import Settings
from core.wire import envelope
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, wait_settled, write_jsonl
from tests.integration.test_pipeline import worker
from tests.workers import EACH_ENGINE

pytestmark = EACH_ENGINE


class Trap:
    """Unpickling it creates ``path``: proof that a payload was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def pickled_message(queue: str, trap: Path) -> bytes:
    """A well-formed Celery envelope for our task whose body is a pickle of ``Trap``."""
    task_id = str(uuid.uuid4())
    message = envelope(1, queue=queue, origin="attacker", task_id=task_id, delivery_tag=task_id)
    message["content-type"] = "application/x-python-serialize"
    message["content-encoding"] = "binary"
    payload = ((Trap(trap),), {}, {"callbacks": None, "errbacks": None, "chain": None})
    message["body"] = base64.b64encode(pickle.dumps(payload)).decode()
    return json.dumps(message).encode()


def test_a_pickled_message_is_refused_and_never_run(
    settings: Settings,
    repo: Repository,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    trap = tmp_path / "executed"
    client = redis.Redis.from_url(settings.services().broker_url)
    try:
        client.lpush(settings.queue, pickled_message(settings.queue, trap))
    finally:
        client.close()
    caplog.set_level(logging.WARNING)
    with worker(settings):
        # Jobs published after it: the worker must pass the bad message to reach them.
        enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(5)))
        states = wait_settled(repo)
    assert states == {"queued": 0, "running": 0, "done": 5, "failed": 0, "skipped_budget": 0}
    assert not trap.exists(), "the pickle was unpickled"
    refusals = [r for r in caplog.records if "pickle" in r.getMessage().lower()]
    assert refusals, [r.getMessage() for r in caplog.records][-10:]
