"""A worker's threads send messages back (``publish_later``) through its one Publisher
(issue 32): on the worker's bounded pool they wait for a connection, where redis-py's default
pool of 100 failed the 101st with MaxConnectionsError."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from core.settings import Settings
from eaglegen.stack import EmbeddedRedis
from tests.outage import wait_for
from worker.runner import REDIS_CONNECTIONS, WorkerContext

THREADS = 150  # more than redis-py's default pool of 100 connections


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis of this test's own: it pauses every write, which no other test should see."""
    server = EmbeddedRedis(tmp_path)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_the_workers_threads_wait_for_a_connection_to_publish(
    settings: Settings, private_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = replace(settings.services(), broker_url=private_redis)
    ctx = WorkerContext.build(settings, services, settings.servers)
    pool = ctx.redis.connection_pool
    asked = 0
    lock = threading.Lock()
    get_connection = pool.get_connection

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal asked
        with lock:
            asked += 1
        return get_connection(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", counted)
    errors: list[BaseException] = []

    def send_back(job_id: int) -> None:
        try:
            ctx.publisher.publish_later(job_id, countdown=0.0, retries=1)
        except BaseException as exc:  # every error is the test's finding
            errors.append(exc)

    watcher = redis.Redis.from_url(private_redis)
    # Every write waits at the server until unpaused, holding its connection meanwhile.
    watcher.client_pause(60_000, all=False)
    threads = [threading.Thread(target=send_back, args=(i,)) for i in range(THREADS)]
    try:
        for thread in threads:
            thread.start()

        def paused() -> int:
            return int(watcher.info("clients")["blocked_clients"])

        # Every thread asked the worker's pool, whose connections all carry a paused write;
        # or some thread failed.
        wait_for(
            lambda: errors or (asked == THREADS and paused() == REDIS_CONNECTIONS),
            "every thread waiting for a connection, or an error",
        )
        assert errors == []
    finally:
        watcher.client_unpause()
        for thread in threads:
            thread.join(timeout=60)
        ctx.close()
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    assert watcher.llen(settings.queue) == THREADS
    watcher.close()
