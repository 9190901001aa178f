"""Slots in Redis, the reconciler and the audit against real services."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from core import wire
from core.broker import PUSH_BYTES, Publisher, waiting_job_ids
from core.settings import Settings
from core.urls import libpq_url
from eaglegen.stack import EmbeddedRedis
from models.records import GenerationRecord
from models.repository import Repository
from tests.helpers import enqueue_file, sample_rows, write_jsonl
from tests.workers import in_thread_worker
from worker.feeder import Feeder
from worker.reconcile import reconcile
from worker.slots import SlotPool


@pytest.fixture
def client(broker_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(broker_url)
    yield conn
    conn.close()


def test_slots_hold_the_limit_and_lapse_when_not_renewed(client: redis.Redis) -> None:
    pool = SlotPool(client, lease_seconds=0.5)
    tokens = [pool.try_acquire("s", limit=3) for _ in range(5)]
    assert sum(t is not None for t in tokens) == 3
    assert pool.in_flight("s") == 3
    pool.release("s", next(t for t in tokens if t is not None))
    assert pool.try_acquire("s", limit=3) is not None
    time.sleep(0.6)  # nobody renewed: a dead worker's slots come back by themselves
    assert pool.in_flight("s") == 0
    assert pool.try_acquire("s", limit=3) is not None


def feed(repo: Repository, url: str, queue: str, window: int = 10_000) -> int:
    """One feeder pass with a window of ``window`` messages; how many it published."""
    with redis.Redis.from_url(url) as client, Publisher(url, queue) as publisher:
        return Feeder(repo, client, publisher, window=window).feed().published


@pytest.mark.embedded
def test_reconciler_republishes_what_redis_lost(
    settings: Settings, repo: Repository, client: redis.Redis, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(30)))
    ids = repo.job_ids()
    url = settings.services().broker_url
    assert waiting_job_ids(client, settings.queue) == set()  # the feeder publishes, not enqueue
    assert feed(repo, url, settings.queue) == 30
    assert waiting_job_ids(client, settings.queue) == set(ids)
    quiet = reconcile(repo, client, settings.queue, max_attempts=3, republish_after_s=0)
    assert quiet.republished == 0  # nothing missing: no duplicate messages
    assert feed(repo, url, settings.queue) == 0
    client.flushdb()  # Redis restarted empty
    report = reconcile(repo, client, settings.queue, max_attempts=3, republish_after_s=0)
    assert (report.republished, report.expired_leases) == (30, 0)
    assert feed(repo, url, settings.queue) == 30
    assert waiting_job_ids(client, settings.queue) == set(ids)


def test_reconciler_requeues_jobs_of_dead_workers(
    settings: Settings, repo: Repository, client: redis.Redis, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(3)))
    url = settings.services().broker_url
    assert feed(repo, url, settings.queue) == 3
    first = wire.job_id_of(client.rpop(settings.queue))  # taken by a worker that then dies
    assert first is not None and repo.claim(first, "dead", lease_seconds=1).job is not None
    time.sleep(1.2)
    report = reconcile(repo, client, settings.queue, max_attempts=3, republish_after_s=60)
    assert (report.expired_leases, report.republished) == (1, 0)
    assert feed(repo, url, settings.queue) == 1
    assert waiting_job_ids(client, settings.queue) == set(repo.job_ids())


def test_audit_passes_on_a_clean_run_and_names_a_broken_ledger(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", sample_rows(2)))
    first, second = repo.job_ids()
    repo.claim(first, "w", 60)
    repo.record(first, "w", GenerationRecord([1, 2], "length", 2, 10, 2, 0, 0.1, "sim"))
    repo.claim(second, "w", lease_seconds=1)
    assert repo.audit(lease_grace_s=60) == []
    time.sleep(1.2)
    assert any("expired" in p for p in repo.audit(lease_grace_s=0))
    assert settings.database_url is not None
    url = libpq_url(settings.database_url)
    with psycopg.connect(url, autocommit=True) as conn:  # corrupt the ledger on purpose
        conn.execute("UPDATE datasets SET used_tokens = used_tokens + 5")
    problems = repo.audit(lease_grace_s=60)
    assert any("used_tokens 7 != 2 recorded" in p for p in problems), problems


def test_the_feeder_publishes_in_bounded_commands(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # A window of N messages goes out in LPUSHes of at most PUSH_BYTES each, not in one
    # command of all N built whole in memory, which for a large window meets the server's
    # client-query-buffer-limit (message size: BENCHMARKS.md).
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3000)]
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows))
    ids = repo.job_ids()
    server = EmbeddedRedis(tmp_path / "private")  # its own command counts
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        assert feed(repo, server.url, settings.queue) == len(ids) == 3000
        assert waiting_job_ids(client, settings.queue) == set(ids)
        total = sum(len(m) for m in client.lrange(settings.queue, 0, -1))
        calls = client.info("commandstats")["cmdstat_lpush"]["calls"]
        assert total > 8 * PUSH_BYTES  # enough messages for several commands
        assert calls >= total / PUSH_BYTES
    finally:
        client.close()
        server.stop()


def test_audit_passes_at_every_moment_of_a_live_run(
    settings: Settings, repo: Repository, tmp_path: Path
) -> None:
    # The audit counts the jobs and reads the datasets' counters: if those are two
    # snapshots, the transitions committed between them read as violations (the issue's
    # "counter jobs_queued is 22514, the jobs say 22518" on a live run). Audit over and
    # over while a worker runs hundreds of short jobs: every audit must pass.
    rows = [{"prompt": f"Question {i}: what is {i} + {i}?"} for i in range(500)]
    enqueue_file(settings, write_jsonl(tmp_path / "d.jsonl", rows), max_new_tokens=8)
    audits: list[list[str]] = []
    with in_thread_worker(settings):
        while True:
            # Whether the run had settled is read before the audit: the last audit then
            # sees the settled run too.
            settled = all(c.states["queued"] + c.states["running"] == 0 for c in repo.counts())
            audits.append(repo.audit(lease_grace_s=600))
            if settled:
                break
    assert len(audits) > 1  # at least one while jobs were in flight
    failed = [problems for problems in audits if problems]
    assert not failed, f"{len(failed)} of {len(audits)} audits failed, first: {failed[0]}"
    assert sum(c.states["done"] for c in repo.counts()) == 500
