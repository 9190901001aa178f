"""The benchmarks' CPU accounting of the services: bench.serving prints Postgres's and Redis's
CPU per round from these, so they must find the servers and count ended backends too."""

from __future__ import annotations

import os
from pathlib import Path

import redis
from sqlalchemy import text

from bench.procs import cpu_seconds, service_pids, tree_cpu_seconds
from models.db import make_engine
from tests.outage import wait_for

# A query that keeps its backend busy long enough for its CPU to show in /proc.
BUSY_QUERY = "SELECT count(*) FROM generate_series(1, 3000000) AS s WHERE s % 7 = 3"


def test_the_services_are_found_and_an_ended_backend_s_cpu_is_counted(
    database_url: str, broker_url: str
) -> None:
    pids = service_pids(database_url, broker_url)
    assert set(pids) == {"postgres", "redis"}, pids
    client = redis.Redis.from_url(broker_url)
    try:
        assert int(client.info("server")["process_id"]) == pids["redis"]
    finally:
        client.close()

    before = tree_cpu_seconds(pids["postgres"])
    engine = make_engine(database_url)
    with engine.connect() as conn:
        backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        conn.execute(text(BUSY_QUERY)).scalar_one()
        used = cpu_seconds(backend)  # this backend's own, while it lives
    engine.dispose()  # the backend ends: its CPU moves to the server's count of ended ones
    wait_for(lambda: not Path(f"/proc/{backend}").exists(), "the backend to end")
    after = tree_cpu_seconds(pids["postgres"])
    assert used > 0.05, f"the busy query used {used:.2f} s of CPU"
    # Within two clock ticks: the kernel rounds an ended child's time to ticks once for its
    # parent, and its own two fields separately; and these are floats.
    assert after - before >= used - 2 / os.sysconf("SC_CLK_TCK"), (before, after, used)


def test_a_remote_service_is_not_counted() -> None:
    # Addresses of other machines: no pid here could be theirs.
    found = service_pids("postgresql://postgres@192.0.2.1:5432/x", "redis://192.0.2.1:6379/0")
    assert found == {}
