"""Limits shared across hosts hold with skewed clocks and unnamed servers: one clock (Redis's)
scores every slot lease, and one server name means one server in the whole cluster."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from core import heartbeat
from core.settings import ServerSpec, Settings
from eaglegen.sim import SimServer
from tests.integration.test_worker_processes import eaglegen, wait_for, worker_env, worker_process
from worker.names import ServerNames
from worker.slots import SlotPool

LEASE_S = 60.0
# A caller on another host: takes two slots of server "gpu" (limit 4) and renews them.
OTHER_HOST = """
import sys, redis
from worker.slots import SlotPool
pool = SlotPool(redis.Redis.from_url(sys.argv[1]), lease_seconds=60.0)
tokens = [pool.try_acquire("gpu", 4) for _ in range(2)]
pool.renew("gpu", [t for t in tokens if t])
print(sum(t is not None for t in tokens), pool.in_flight("gpu"))
"""


@pytest.mark.needs("faketime")
@pytest.mark.parametrize("skew", ["+120s", "-120s"])
def test_a_caller_whose_clock_is_off_by_more_than_a_lease_keeps_every_lease(
    broker_url: str, skew: str
) -> None:
    client = redis.Redis.from_url(broker_url)
    try:
        pool = SlotPool(client, lease_seconds=LEASE_S)
        ours = [pool.try_acquire("gpu", 4) for _ in range(2)]
        assert all(ours)
        # A real process whose clock is two minutes off (libfaketime), as on another host.
        other = subprocess.run(
            ["faketime", "-f", skew, sys.executable, "-c", OTHER_HOST, broker_url],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert other.stdout.split() == ["2", "4"]  # it took two slots and sees all four
        assert pool.in_flight("gpu") == 4  # ours are still there, and its are live
        assert pool.try_acquire("gpu", 4) is None  # the limit holds across both hosts
    finally:
        client.close()


def test_an_unnamed_server_is_named_by_where_it_is() -> None:
    here = socket.gethostname()
    assert ServerSpec(url="http://10.1.2.3:30000/").name == "10.1.2.3:30000"
    # Loopback is a different server on each host: named by this host.
    assert ServerSpec(url="http://127.0.0.1:30000").name == f"{here}:30000"
    assert ServerSpec(url="http://localhost:30001").name == f"{here}:30001"
    assert ServerSpec(name="gpu0", url="http://localhost:30001").name == "gpu0"


def test_one_worker_refuses_one_name_for_two_servers() -> None:
    with pytest.raises(ValueError, match="server name 'gpu' given for http://a:1 and"):
        Settings(
            servers=[
                ServerSpec(name="gpu", url="http://a:1"),
                ServerSpec(name="gpu", url="http://b:1"),
            ]
        )


def test_a_name_held_for_one_server_is_refused_for_another(broker_url: str) -> None:
    client = redis.Redis.from_url(broker_url)
    try:
        names = ServerNames(client, ttl_s=5)
        first = ServerSpec(name="gpu", url="http://10.0.0.1:30000")
        assert names.hold([first]) == []
        assert names.hold([first]) == []  # renewal by the same or another worker of it
        [conflict] = names.hold([ServerSpec(name="gpu", url="http://10.0.0.2:30000")])
        assert "server name 'gpu' is in use for 10.0.0.1:30000 by another worker" in conflict
        assert "not 10.0.0.2:30000" in conflict
    finally:
        client.delete("eaglegen:server-name:gpu")
        client.close()


def test_a_second_worker_naming_another_server_like_the_first_exits_2(
    settings: Settings, sim: SimServer, tmp_path: Path
) -> None:
    assert settings.broker_url is not None
    name = f"gpu-{settings.queue}"
    first = worker_env(settings, [{"name": name, "url": sim.url}])
    with worker_process(first, tmp_path / "first.log"):
        wait_for(lambda: heartbeat.alive(settings.broker_url or "", None, 60), 60, "a heartbeat")
        second = worker_env(settings, [{"name": name, "url": "http://10.0.0.9:30000"}])
        result = eaglegen(second, "worker")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    message = " ".join(result.stderr.split())
    assert f"error: server name '{name}' is in use for" in message
    assert "10.0.0.9:30000" in message
    assert "Traceback" not in result.stderr and len(lines) <= 3
