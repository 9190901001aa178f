"""Redis restarted empty and Postgres restarted, each in the middle of a run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import redis

from core.settings import Settings
from core.urls import libpq_url
from eaglegen.sim import SimServer
from models.db import upgrade
from models.repository import Repository
from tests.faults.conftest import FleetFactory, OwnServicesRun
from tests.faults.harness import (
    Fleet,
    PrivatePostgres,
    PrivateRedis,
    assert_exactly_once,
    attempts_histogram,
    fault_settings,
    make_repo,
    report,
    seed_jobs,
    state_counts,
    wait_for,
    wait_settled,
    worker_env,
)
from tests.workers import EACH_ENGINE
from worker.transport import Channel

pytestmark = [pytest.mark.faults, EACH_ENGINE]

JOBS = 600
DOWNTIME_S = 2.0
# Celery 5.7 + kombu 5.7, threads pool: after a lost connection, work still queued on the
# collected channel builds a Redis client from a transport whose client is None.
REDIS_CRASH = "\"Unrecoverable error: AttributeError(... 'hostname')\" in the worker log"


def test_redis_restarted_empty_mid_run_loses_nothing(
    fast_settings: Settings,
    repo: Repository,
    fleet: Fleet,
    private_redis: PrivateRedis,
) -> None:
    """Every message, slot and heartbeat vanishes; the reconciler rebuilds from Postgres."""
    total = len(seed_jobs(fast_settings, JOBS))
    fleet.start()
    fleet.start()
    _wait_done(repo, fleet, total // 4)
    private_redis.stop()
    lost = state_counts(repo)["queued"]
    time.sleep(DOWNTIME_S)  # the outage itself: workers must ride it out
    private_redis.start()  # a new process without persistence: nothing survived
    wait_settled(repo, fleet, timeout_s=150, supervise=True)
    assert_exactly_once(repo, total, fleet)
    # Idle on their new connections: every write to kombu's unacked index, each delivery's
    # and each ack's removal, reached the new Redis (worker.transport sends them in batches
    # at a turn of the loop).
    broker = redis.Redis.from_url(private_redis.url)

    def none_unacked() -> bool:
        return broker.hlen(Channel.unacked_key) + broker.zcard(Channel.unacked_index_key) == 0

    wait_for(none_unacked, 30, "no message left unacked", fleet.tails)
    broker.close()
    report(
        "redis restart",
        jobs=total,
        queued_when_lost=lost,
        attempts=attempts_histogram(repo),
        crashed_workers=fleet.crashed,
        **fleet.reconciler_totals(),
    )
    # Every job was done once; the worker processes must have survived the outage too.
    assert not fleet.crashed, f"{fleet.crashed} died of the outage ({REDIS_CRASH})"


def test_postgres_restarted_mid_run_loses_nothing(
    own_services_run: OwnServicesRun, private_postgres: PrivatePostgres
) -> None:
    """Every connection is cut; workers reconnect (pool_pre_ping) and leases recover."""
    settings, repo, fleet = own_services_run
    total = len(seed_jobs(settings, JOBS))
    fleet.start()
    fleet.start()
    _wait_done(repo, fleet, total // 4)
    private_postgres.stop()
    time.sleep(DOWNTIME_S)
    private_postgres.start()
    wait_settled(repo, fleet, timeout_s=150)
    assert_exactly_once(repo, total, fleet)
    _assert_all_running(fleet)
    report(
        "postgres restart",
        jobs=total,
        tasks_failed_on_db=fleet.log_count("raised unexpected: OperationalError"),
        attempts=attempts_histogram(repo),
        **fleet.reconciler_totals(),
    )


def _wait_done(repo: Repository, fleet: Fleet, done: int) -> None:
    wait_for(lambda: state_counts(repo)["done"] >= done, 120, f"{done} done jobs", fleet.tails)


def _assert_all_running(fleet: Fleet) -> None:
    """No worker process died of the outage."""
    assert all(w.running() for w in fleet.workers), fleet.tails()


def test_workers_fit_a_postgres_of_few_connections_and_leave_some_for_commands(
    private_postgres: PrivatePostgres,
    private_redis: PrivateRedis,
    sim: SimServer,
    fleet_factory: FleetFactory,
    tmp_path: Path,
    worker_engine: str,
) -> None:
    """Three workers of 64 threads against max_connections = 30: each opened up to 64 before."""
    plain = libpq_url(private_postgres.url)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 30")
    private_postgres.stop()
    private_postgres.start()
    upgrade(private_postgres.url)
    settings = fault_settings(private_postgres.url, private_redis.url, tmp_path, worker_engine)
    settings = settings.model_copy(update={"worker_concurrency": 64})
    repo = make_repo(settings)
    fleet = fleet_factory(settings, [f"sim={sim.url}"])
    try:
        total = len(seed_jobs(settings, JOBS))
        for _ in range(3):
            fleet.start()
        _wait_done(repo, fleet, total // 3)
        # A control command mid-run finds a connection.
        budget = subprocess.run(
            [sys.executable, "-m", "eaglegen", "budget", "set", "d", "100M"],
            env=worker_env(settings),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert budget.returncode == 0, budget.stderr
        wait_settled(repo, fleet, timeout_s=150)
        assert_exactly_once(repo, total, fleet)
        _assert_all_running(fleet)
        assert fleet.log_count("too many clients") == 0, fleet.tails()
        assert fleet.log_count("at most 8 Postgres connections") == 3
    finally:
        repo.engine.dispose()
