"""Issue 13: Redis carries a bounded window, so a Redis that evicts keys under memory
pressure (allkeys-lru, common in production) costs time, never a job."""

from __future__ import annotations

import pytest
import redis

from core.settings import Settings
from models.repository import Repository
from tests.faults.harness import (
    Fleet,
    PrivateRedis,
    assert_exactly_once,
    report,
    seed_jobs,
    wait_settled,
)
from tests.workers import EACH_ENGINE

pytestmark = [pytest.mark.faults, EACH_ENGINE]

JOBS = 1500
# Filler that keeps the Redis at its maxmemory, so that every write evicts something.
FILLER_KEYS = 4000
FILLER_BYTES = 1024


def test_a_redis_evicting_under_allkeys_lru_ends_with_every_job_done_once(
    fast_settings: Settings, repo: Repository, fleet: Fleet, private_redis: PrivateRedis
) -> None:
    """Messages, slots, heartbeats and locks may be evicted at any write; the reconciler
    and the feeder rebuild what Postgres says is missing, and the claim keeps it once."""
    client = redis.Redis.from_url(private_redis.url)
    try:
        base = int(client.info("memory")["used_memory"])
        # Room for a few windows of messages above what Redis holds now: a publish of
        # every job at enqueue would need several times more (message size: BENCHMARKS.md).
        client.config_set("maxmemory", str(base + (2 << 20)))
        client.config_set("maxmemory-policy", "allkeys-lru")
        with client.pipeline(transaction=False) as pipe:
            for i in range(FILLER_KEYS):
                pipe.set(f"filler:{i}", b"x" * FILLER_BYTES)
            pipe.execute()
        assert int(client.info("stats")["evicted_keys"]) > 0  # at its limit from the start
        total = len(seed_jobs(fast_settings, JOBS))
        fleet.start()
        fleet.start()
        wait_settled(repo, fleet, timeout_s=240, supervise=True)
        assert_exactly_once(repo, total, fleet)
        evicted = int(client.info("stats")["evicted_keys"])
        report(
            "allkeys-lru",
            jobs=total,
            evicted_keys=evicted,
            crashed_workers=fleet.crashed,
            **fleet.reconciler_totals(),
        )
    finally:
        client.close()
