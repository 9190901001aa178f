"""Hundreds of a worker's threads waiting for slots on full servers (issue 32): they share a
bounded set of Redis connections, waiting for one instead of failing, and ask Redis for a
slot at a pace that does not grow with their count."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import redis

from bench.slot_wait import CountedSlots
from core.settings import ServerSpec
from worker.runner import REDIS_CONNECTIONS, worker_redis
from worker.servers import Router, Server
from worker.sglang import SGLangClient

THREADS = 150  # more than redis-py's default pool of 100 connections


@pytest.fixture
def client(broker_url: str) -> Iterator[redis.Redis]:
    client = worker_redis(broker_url)
    yield client
    client.close()


def run_threads(target: Callable[[], object], n: int = THREADS) -> list[BaseException]:
    """Run ``target`` in ``n`` threads at once; the errors they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run() -> None:
        start.wait()
        try:
            target()
        except BaseException as exc:  # every error is the test's finding
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_more_threads_than_connections_wait_for_one_instead_of_failing(
    client: redis.Redis,
) -> None:
    # Each holds its connection for 0.2 s (a blocking pop on an empty list), all at once.
    errors = run_threads(lambda: client.blpop(["eaglegen:test:empty"], timeout=0.2))
    assert errors == []  # redis-py's default pool: MaxConnectionsError past 100
    pool = client.connection_pool
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert len(pool._connections) <= REDIS_CONNECTIONS


def test_threads_waiting_on_a_full_server_ask_redis_at_a_bounded_pace(
    client: redis.Redis,
) -> None:
    server = Server(ServerSpec(name="full", url="http://127.0.0.1:9"), SGLangClient(
        ServerSpec(name="full", url="http://127.0.0.1:9"), timeout_s=1
    ), limit=1)  # fmt: skip
    slots = CountedSlots(client, lease_seconds=60)
    router = Router([server], slots)
    held = router.acquire(1.0)
    assert held is not None
    waiters, wait_s = 50, 2.0
    before = slots.tries
    got: list[object] = []
    errors = run_threads(lambda: got.append(router.acquire(wait_s)), waiters)
    calls = slots.tries - before
    assert errors == [] and got == [None] * waiters  # the server stayed full
    # Pauses doubling up to MAX_POLL_S bound the tries per waiter, whatever their number
    # (against a fixed pause: BENCHMARKS.md, "Threads waiting for a slot").
    assert calls <= waiters * 12, f"{calls} tries by {waiters} threads in {wait_s} s"
    # A slot this process gives back goes to a waiting thread (woken for it).
    taken = threading.Event()

    def wait() -> None:
        if router.acquire(60.0) is not None:
            taken.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    router.release(held)
    waiter.join(timeout=60)
    assert taken.is_set()
    server.client.close()
