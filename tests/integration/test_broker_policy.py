"""A Redis that may evict keys (queued messages among them) is named at worker start and by
`eaglegen status`; Redis's own default, noeviction, is not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from core.settings import Settings
from eaglegen.sim import SimServer
from eaglegen.stack import EmbeddedRedis
from tests.integration.test_worker_processes import eaglegen, wait_for, worker_env, worker_process

WARNING = "Redis maxmemory-policy is allkeys-lru"


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[str]:
    """A private Redis with an eviction policy, as production setups often have."""
    server = EmbeddedRedis(tmp_path / "evicting")
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.close()
    try:
        yield server.url
    finally:
        server.stop()


def test_status_names_an_evicting_redis(settings: Settings, evicting_redis: str) -> None:
    env = worker_env(settings, [])
    quiet = eaglegen(env, "status")
    assert quiet.returncode == 0 and "maxmemory-policy" not in quiet.stderr
    loud = eaglegen({**env, "EAGLEGEN_BROKER_URL": evicting_redis}, "status")
    assert loud.returncode == 0
    assert WARNING in " ".join(loud.stderr.split())
    assert "noeviction" in loud.stderr


def test_a_worker_on_an_evicting_redis_says_so_at_start(
    settings: Settings, sim: SimServer, evicting_redis: str, tmp_path: Path
) -> None:
    env = {
        **worker_env(settings, [{"name": "sim", "url": sim.url}]),
        "EAGLEGEN_BROKER_URL": evicting_redis,
    }
    log = tmp_path / "worker.log"
    with worker_process(env, log):
        wait_for(lambda: WARNING in " ".join(log.read_text().split()), 60, "the warning", log)
